"""The model's tokenizer and chat template, loaded from the model folder.

Only `transformers.AutoTokenizer` is used: the gateway never runs the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gateway_service.errors import InvalidRequest
from radixserve.v1 import generation_pb2


class Tokenizer:
    """Prompt and chat encoding, decoding, and the text of single tokens."""

    def __init__(self, hf_tokenizer) -> None:
        self._hf = hf_tokenizer
        self.vocab_size: int = len(hf_tokenizer)
        self.has_chat_template: bool = bool(getattr(hf_tokenizer, "chat_template", None))

    @classmethod
    def load(cls, model_dir: str | Path) -> "Tokenizer":
        from transformers import AutoTokenizer  # heavy import, done once at startup

        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    @property
    def hf(self):
        """The Hugging Face tokenizer itself (the grammar compiler indexes its vocabulary)."""
        return self._hf

    def encode_prompt(self, text: str) -> list[int]:
        """A plain prompt, with the special tokens the model's tokenizer adds by itself."""
        return list(self._hf.encode(text))

    def encode_chat(self, turns: Sequence[generation_pb2.ChatMessage]) -> list[int]:
        """The chat template applied with the generation prompt, then tokenized.

        The rendered template already holds its special tokens, so none are added again
        (what `apply_chat_template(..., tokenize=True)` does too).
        """
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template: send a prompt instead of messages")
        messages = [{"role": t.role, "content": t.content} for t in turns]
        try:
            text = self._hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template's own raise_exception(...) is a caller mistake
            raise InvalidRequest(f"the chat template rejected the messages: {exc}") from exc
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Output text: special tokens (end of sequence and the like) are left out."""
        return self._hf.decode(list(token_ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (for logprobs)."""
        return self._hf.decode([token_id], skip_special_tokens=False)
