"""Turning the router's token-id stream into the client's text stream.

For each router response: detokenize token by token, cut at stop strings, attach token text to
logprobs. The tokens after the one that completed a stop string are dropped, and so is the
stop string itself; the caller then cancels the router stream.

Chunks are the public `GenerateResponse` message itself; its finish reason is the proto enum
(`FINISH_REASON_UNSPECIFIED`, 0, while the request runs; `radixserve.finish_reason` has its
words).

Usage counts the prompt and the tokens passed to the client. `cached_tokens` comes from the
router, which reports it on every response, so it is right even when a stop string ends the
request early.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway_service.detokenizer import IncrementalDetokenizer
from gateway_service.stop_strings import StopStringMatcher
from gateway_service.tokenizer import Tokenizer
from radixserve.v1 import generation_pb2

STOP = generation_pb2.FINISH_REASON_STOP
# What `OutputAssembler.is_cheap` lets run on the event loop: each token decodes its window twice
# (~3 us for a few tokens with SmolLM2's tokenizer), each logprob text once.
CHEAP_TOKENS, CHEAP_WINDOW, CHEAP_TEXTS = 4, 32, 8


class OutputAssembler:
    """Stateful per request. `add` returns the chunk to send (None when there is nothing new);
    once `finished` is True no more chunks come and the router stream may be dropped."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], prompt_len: int) -> None:
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer.decode, tokenizer.decode_one)
        self._matcher = StopStringMatcher(stop)
        self._has_stops = bool(stop)
        self._prompt_len = prompt_len
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0
        self.drafts = (0, 0)  # the router's (drafted, accepted) draft tokens so far
        self.finished = False

    @property
    def has_stops(self) -> bool:
        """Whether stop strings may end the output at any token."""
        return self._has_stops

    def is_cheap(self, token_ids: Sequence[int], logprobs: Sequence[generation_pb2.TokenLogprob] = ()) -> bool:
        """Whether `add` of these is a few microseconds of work: a decode step's token or few over a
        short window, with few logprob texts. Such work costs less on the event loop than the
        hand-off to a thread and back; anything larger (a long chunk, text held back over many
        tokens, many top logprobs) goes to the decode threads."""
        if len(token_ids) > CHEAP_TOKENS or self._detokenizer.window > CHEAP_WINDOW:
            return False
        if not logprobs:
            return True
        return sum(1 + len(logprob.top_logprobs) for logprob in logprobs[:len(token_ids)]) <= CHEAP_TEXTS

    def add_plain(self, token_ids: Sequence[int]) -> generation_pb2.GenerateResponse | None:
        """`add(token_ids)` of tokens with nothing else new (bare tokens, most of a stream):
        without stop strings to hold text back, the way is shorter."""
        if self._has_stops or self.finished:
            return self.add(token_ids)
        detokenize = self._detokenizer.add
        text = detokenize(token_ids[0]) if len(token_ids) == 1 else "".join([detokenize(t) for t in token_ids])
        self.num_completion_tokens += len(token_ids)
        chunk = generation_pb2.GenerateResponse()
        chunk.token_ids.extend(token_ids)
        if text:
            chunk.text = text
        return chunk if token_ids or text else None

    def add(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[generation_pb2.TokenLogprob] = (),
        finish_reason: int = generation_pb2.FINISH_REASON_UNSPECIFIED,
        cached_tokens: int = 0,
        drafts: tuple[int, int] = (0, 0),
    ) -> generation_pb2.GenerateResponse | None:
        """`logprobs` come without token text; the chunk's have it. `drafts`: the router's
        drafted and accepted draft token counts so far (speculative decoding)."""
        if self.finished:
            raise RuntimeError("output already finished")
        if cached_tokens > self.num_cached_tokens:
            self.num_cached_tokens = cached_tokens
        if drafts > self.drafts:
            self.drafts = drafts
        pieces: list[str] = []
        num_taken = 0
        detokenize = self._detokenizer.add
        for token_id in token_ids:
            num_taken += 1
            if not self._has_stops:  # nothing to hold back or cut: the text as it is final
                pieces.append(detokenize(token_id))
                continue
            result = self._matcher.feed(detokenize(token_id))
            pieces.append(result.text)
            if result.stopped:
                finish_reason = STOP
                break
        self.num_completion_tokens += num_taken
        # Fields are filled in place, which is cheaper than keyword arguments to the constructor.
        chunk = generation_pb2.GenerateResponse()
        chunk.token_ids.extend(token_ids if num_taken == len(token_ids) else token_ids[:num_taken])
        if logprobs:
            chunk.logprobs.extend(logprobs[:num_taken])
            self._add_token_text(chunk.logprobs)
        if finish_reason:
            if not self._matcher.stopped:
                tail = self._matcher.feed(self._detokenizer.flush())
                pieces.append(tail.text)
                if not tail.stopped:
                    tail = self._matcher.flush()
                    pieces.append(tail.text)
                if tail.stopped:
                    finish_reason = STOP
            self.finished = True
            chunk.text, chunk.finish_reason = "".join(pieces), finish_reason
            usage = chunk.usage
            usage.prompt_tokens = self._prompt_len
            usage.completion_tokens = self.num_completion_tokens
            usage.cached_tokens = self.num_cached_tokens
            usage.draft_tokens = self.drafts[0]
            # A stop string may cut the output inside an accepted run: count only the accepted
            # drafts that can be among the tokens passed on.
            usage.accepted_draft_tokens = min(self.drafts[1], self.num_completion_tokens)
            return chunk
        text = pieces[0] if len(pieces) == 1 else "".join(pieces)
        if not num_taken and not text:
            return None
        chunk.text = text
        return chunk

    def _add_token_text(self, logprobs: Sequence[generation_pb2.TokenLogprob]) -> None:
        text = self._tokenizer.token_text
        for logprob in logprobs:
            logprob.token = text(logprob.token_id)
            for top in logprob.top_logprobs:
                top.token = text(top.token_id)
