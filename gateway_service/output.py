"""Turning the router's token-id stream into the client's text stream.

For each router response: detokenize token by token, cut at stop strings, attach token text to
logprobs. The tokens after the one that completed a stop string are dropped, and so is the
stop string itself; the caller then cancels the router stream.

Usage counts the prompt and the tokens passed to the client. `cached_tokens` comes from the
router, which reports it on every response, so it is right even when a stop string ends the
request early.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gateway_service.detokenizer import IncrementalDetokenizer
from gateway_service.stop_strings import StopStringMatcher
from gateway_service.tokenizer import Tokenizer
from gateway_service.values import FinishReason, OutputChunk, TokenLogprob, Usage


class OutputAssembler:
    """Stateful per request. `add` returns the chunk to send (None when there is nothing new);
    once `finished` is True no more chunks come and the router stream may be dropped."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], prompt_len: int) -> None:
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer.decode)
        self._matcher = StopStringMatcher(stop)
        self._prompt_len = prompt_len
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0
        self.finished = False

    def add(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprob] = (),
        finish_reason: FinishReason | None = None,
        cached_tokens: int = 0,
    ) -> OutputChunk | None:
        if self.finished:
            raise RuntimeError("output already finished")
        self.num_cached_tokens = max(self.num_cached_tokens, cached_tokens)
        pieces: list[str] = []
        taken: list[int] = []
        for token_id in token_ids:
            taken.append(token_id)
            result = self._matcher.feed(self._detokenizer.add(token_id))
            pieces.append(result.text)
            if result.stopped:
                finish_reason = FinishReason.STOP
                break
        self.num_completion_tokens += len(taken)
        token_logprobs = [self._with_text(lp) for lp in logprobs[:len(taken)]]
        if finish_reason is not None:
            if not self._matcher.stopped:
                tail = self._matcher.feed(self._detokenizer.flush())
                pieces.append(tail.text)
                if not tail.stopped:
                    tail = self._matcher.flush()
                    pieces.append(tail.text)
                if tail.stopped:
                    finish_reason = FinishReason.STOP
            self.finished = True
            usage = Usage(
                prompt_tokens=self._prompt_len,
                completion_tokens=self.num_completion_tokens,
                cached_tokens=self.num_cached_tokens,
            )
            return OutputChunk("".join(pieces), taken, token_logprobs, finish_reason, usage)
        text = "".join(pieces)
        if not taken and not text:
            return None
        return OutputChunk(text, taken, token_logprobs)

    def _with_text(self, logprob: TokenLogprob) -> TokenLogprob:
        text = self._tokenizer.token_text
        return replace(
            logprob,
            token=text(logprob.token_id),
            top_logprobs=tuple(replace(t, token=text(t.token_id)) for t in logprob.top_logprobs),
        )
