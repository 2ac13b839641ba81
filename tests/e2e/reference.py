"""transformers' greedy outputs for a few chats: the numerical reference of the e2e tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Chats whose greedy completions the stack must reproduce token for token.
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about servers."}],
]
MAX_NEW_TOKENS = 16


@dataclass(frozen=True)
class Reference:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finished_by_eos: bool


def greedy_references(model_dir: Path) -> list[Reference]:
    """`AutoModelForCausalLM` + `apply_chat_template` + `generate(do_sample=False)` per chat, for
    a model folder or a GGUF file (transformers dequantizing it; tokenizer and template from it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixserve.model_source import resolve_model

    # One thread: on a busy two-core machine more threads spin against each other.
    torch.set_num_threads(1)
    source = resolve_model(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(source.folder, **source.hf_kwargs())
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32, **source.hf_kwargs()).eval()
    # `generate` stops on every id the generation config lists, as the stack does.
    eos = model.generation_config.eos_token_id
    eos_token_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    references = []
    for chat in CHATS:
        inputs = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
        prompt_ids = inputs["input_ids"][0].tolist()
        output_ids = out[0, len(prompt_ids):].tolist()
        references.append(Reference(
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            text=tokenizer.decode(output_ids, skip_special_tokens=True),
            finished_by_eos=output_ids[-1] in eos_token_ids,
        ))
    return references
