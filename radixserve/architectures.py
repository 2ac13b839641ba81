"""The model architectures the worker runs, by their `config.json` name: one list that the
worker's model registry (`worker_service.models`) is held to and that `radixserve up` checks a
model folder against before it starts anything (no torch needed here)."""

from __future__ import annotations

from collections.abc import Sequence

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM",
    "GraniteForCausalLM", "Olmo2ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "SmolLM3ForCausalLM",
    "Qwen2MoeForCausalLM", "Olmo3ForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM",
    "Ernie4_5ForCausalLM", "SeedOssForCausalLM", "Exaone4ForCausalLM", "GptOssForCausalLM",
    "GraniteMoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "Ernie4_5_MoeForCausalLM",
    "CohereForCausalLM", "Cohere2ForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteMoeHybridForCausalLM",
    "AfmoeForCausalLM", "Dots1ForCausalLM", "HunYuanDenseV1ForCausalLM",
    "ApertusForCausalLM",
)


def unsupported(architectures: Sequence[str]) -> str | None:
    """The one-line refusal where none of `architectures` is supported, else None."""
    if any(name in SUPPORTED_ARCHITECTURES for name in architectures):
        return None
    return f"unsupported architecture {list(architectures)}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
