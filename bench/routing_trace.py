"""The simulator's trace (bench/simulate_routing.py): chat sessions over Zipf-popular system
prompts, each turn resending the whole history, arriving as a Poisson process.

Each arrival is either a new session (a system prompt drawn by Zipf popularity, then a user
message) or the next turn of a session whose last answer is back (its system prompt, every
earlier message and answer, then a new message), so sessions are closed loops, as users are:
nobody sends turn k+1 before reading answer k. Token ids are random (so only real sharing
matches) and every answer's tokens are drawn when its turn is, so the same seed gives every
policy the same conversations.
"""

from __future__ import annotations

import array
import bisect
import itertools
import random
from dataclasses import dataclass

VOCAB_SIZE = 49152  # SmolLM2's; id 0 is left out (the simulated EOS, never sampled)


@dataclass(frozen=True, slots=True)
class TraceConfig:
    num_system_prompts: int = 64
    zipf_exponent: float = 1.1  # popularity of the k-th prompt ~ k^-s
    system_len: tuple[int, int] = (256, 1024)  # token counts, uniform in [low, high]
    user_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (8, 48)
    new_session_share: float = 0.3  # of arrivals, when some session is ready for its next turn
    max_turns: int = 6
    token_ids: tuple[int, int] = (1, VOCAB_SIZE)  # ids are drawn from [low, high)


@dataclass(slots=True, eq=False)
class Session:
    history: list[int]  # every token sent and answered so far
    num_turns: int = 0


@dataclass(slots=True, eq=False)
class Turn:
    """One request: its prompt (the session's history plus a new message) and its answer."""

    session: Session
    prompt_ids: list[int]
    output_ids: list[int]
    arrival_s: float = 0.0
    continues_session: bool = False
    # Tokens at the head of the prompt that an earlier prompt had: the whole history for a
    # continued turn, the system prompt for a new session (bench/routing_ceiling.py).
    shared_len: int = 0


def _tokens(rng: random.Random, length: int, token_ids: tuple[int, int]) -> list[int]:
    """`length` random ids in [low, high) (from random bytes: the modulo's bias is far below
    anything the simulation measures)."""
    low, high = token_ids
    return [low + word % (high - low) for word in array.array("I", rng.randbytes(4 * length))]


class TraceSource:
    """Turns at Poisson arrivals of `rate_per_s`; `answered` makes a session ready again.

    The arrival times come from their own random stream, so they are the same for every policy;
    what each arrival sends depends on which sessions are ready, which depends on the policy.
    """

    def __init__(self, config: TraceConfig, rate_per_s: float, seed: int) -> None:
        self.config = config
        self._arrivals = random.Random(seed)
        self._rng = random.Random(seed + 1)
        prompts_rng = random.Random(seed + 2)  # the prompts depend on the seed only
        low, high = config.system_len
        self._system_prompts = [
            _tokens(prompts_rng, prompts_rng.randint(low, high), config.token_ids) for _ in range(config.num_system_prompts)
        ]
        weights = [rank ** -config.zipf_exponent for rank in range(1, config.num_system_prompts + 1)]
        self._cumulative = list(itertools.accumulate(weights))
        self._ready: list[Session] = []
        self._rate_per_s = rate_per_s
        self.next_arrival_s = self._arrivals.expovariate(rate_per_s)

    def take(self) -> Turn:
        """The turn arriving at `next_arrival_s` (drawn now, from the sessions ready now)."""
        rng = self._rng
        if self._ready and rng.random() >= self.config.new_session_share:
            session = self._ready.pop(rng.randrange(len(self._ready)))
            continues = True
        else:
            pick = bisect.bisect_left(self._cumulative, rng.random() * self._cumulative[-1])
            session = Session(list(self._system_prompts[pick]))
            continues = False
        shared_len = len(session.history)
        prompt = session.history + _tokens(rng, rng.randint(*self.config.user_len), self.config.token_ids)
        output = _tokens(rng, rng.randint(*self.config.output_len), self.config.token_ids)
        session.num_turns += 1
        session.history = prompt + output
        turn = Turn(session, prompt, output, self.next_arrival_s, continues, shared_len)
        self.next_arrival_s += self._arrivals.expovariate(self._rate_per_s)
        return turn

    def answered(self, turn: Turn) -> None:
        """The turn's last token is back: its session may send its next turn."""
        if turn.session.num_turns < self.config.max_turns:
            self._ready.append(turn.session)
