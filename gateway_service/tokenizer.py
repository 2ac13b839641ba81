"""The model's tokenizer and chat template, loaded from the model folder or GGUF file
(`radixserve.model_source`).

Only `transformers.AutoTokenizer` is used: the gateway never runs the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gateway_service.errors import InvalidRequest
from radixserve.model_source import load_tokenizer, resolve_model
from radixserve.v1 import generation_pb2

# Single tokens whose text `decode_one` keeps (a vocabulary's worth for most models: a few MB).
MAX_REMEMBERED_TOKENS = 1 << 18


class Tokenizer:
    """Prompt and chat encoding, decoding, and the text of single tokens."""

    def __init__(self, hf_tokenizer) -> None:
        self._hf = hf_tokenizer
        self.vocab_size: int = len(hf_tokenizer)
        template = getattr(hf_tokenizer, "chat_template", None)
        self.has_chat_template: bool = bool(template)
        # The default template's source (a named set of templates: the "default" one).
        self.chat_template: str = (template.get("default", "") if isinstance(template, dict) else template) or ""
        # Special tokens whose text output keeps (markers the parsers read, see `keep_special`).
        self._kept_ids: set[int] = set()
        # A fast tokenizer's own (Rust) tokenizer decodes what its Python wrapper would, at a
        # quarter of the cost per call (which the stream pays twice per token, see
        # detokenizer.py), unless the wrapper cleans up spaces after decoding.
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        cleans_up = getattr(hf_tokenizer, "clean_up_tokenization_spaces", False)
        self._backend_decode = backend.decode if backend is not None and not cleans_up else None
        # Output text of single tokens (`decode_one`), filled as tokens are met.
        self._one: dict[int, str] = {}

    @classmethod
    def load(cls, model: str | Path) -> "Tokenizer":
        return cls(load_tokenizer(resolve_model(model)))

    @property
    def hf(self):
        """The Hugging Face tokenizer itself (the grammar compiler indexes its vocabulary)."""
        return self._hf

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A plain prompt, with the special tokens the model's tokenizer adds by itself."""
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_chat(self, turns: Sequence[generation_pb2.ChatMessage]) -> list[int]:
        """The chat template applied with the generation prompt, then tokenized."""
        return self.encode_rendered(self.apply_template([{"role": t.role, "content": t.content} for t in turns]))

    def apply_template(self, messages: list[dict], tools: list[dict] | None = None,
                       template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> str:
        """The chat template rendered (`tools` and `template_kwargs` passed on to it)."""
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template: send a prompt instead of messages")
        try:
            return self._hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                tokenize=False, **(template_kwargs or {}))
        except Exception as exc:  # the template's own raise_exception(...) is a caller mistake
            raise InvalidRequest(f"the chat template rejected the messages: {exc}") from exc

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered template: it already holds its special tokens, so none are added again
        (what `apply_chat_template(..., tokenize=True)` does too)."""
        return list(self._hf.encode(text, add_special_tokens=False))

    def keep_special(self, text: str) -> int | None:
        """When `text` is one special token (Mistral's `[TOOL_CALLS]`), keep it in output text
        from now on, since a parser reads it; returns its id (None: not a special token)."""
        token_id = self._hf.convert_tokens_to_ids(text)
        added = self._hf.added_tokens_decoder.get(token_id) if isinstance(token_id, int) else None
        if added is None or not added.special or added.content != text:
            return None
        self._kept_ids.add(token_id)
        self._one.clear()  # its text is output from now on
        return token_id

    def decode(self, token_ids: Sequence[int]) -> str:
        """Output text: special tokens (end of sequence and the like) are left out, but for
        the kept ones."""
        token_ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        if not self._kept_ids or self._kept_ids.isdisjoint(token_ids):
            return self._decode(token_ids, True)
        pieces, start = [], 0
        for index, token_id in enumerate(token_ids):
            if token_id in self._kept_ids:
                pieces.append(self._decode(token_ids[start:index], True))
                pieces.append(self._decode([token_id], False))
                start = index + 1
        pieces.append(self._decode(token_ids[start:], True))
        return "".join(pieces)

    def decode_one(self, token_id: int) -> str:
        """`decode([token_id])`, remembered: the detokenizer's left context is one token at
        almost every step (detokenizer.py), so a lookup saves a decode per streamed token."""
        text = self._one.get(token_id)
        if text is None:
            text = self.decode([token_id])
            if len(self._one) < MAX_REMEMBERED_TOKENS:
                self._one[token_id] = text
        return text

    def decode_all(self, token_ids: Sequence[int]) -> str:
        """Any token ids as text, special tokens included (Detokenize, echoed prompts)."""
        return self._decode(list(token_ids), False)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (for logprobs)."""
        return self._decode([token_id], False)

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._hf.decode(token_ids, skip_special_tokens=skip_special_tokens)
