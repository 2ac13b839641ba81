"""Our own model implementations, chosen by the checkpoint's `architectures` entry."""

from __future__ import annotations

from typing import Any

from radixserve.architectures import unsupported
from worker_service.models.base import CausalLM
from worker_service.models.afmoe import AfmoeForCausalLM
from worker_service.models.apertus import ApertusForCausalLM
from worker_service.models.cohere import Cohere2ForCausalLM, CohereForCausalLM
from worker_service.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from worker_service.models.dots1 import Dots1ForCausalLM
from worker_service.models.ernie4_5 import Ernie4_5ForCausalLM
from worker_service.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
from worker_service.models.exaone4 import Exaone4ForCausalLM
from worker_service.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from worker_service.models.glm import Glm4ForCausalLM, GlmForCausalLM
from worker_service.models.glm4_moe import Glm4MoeForCausalLM
from worker_service.models.gpt_oss import GptOssForCausalLM
from worker_service.models.granite import GraniteForCausalLM
from worker_service.models.granite_hybrid import GraniteMoeHybridForCausalLM, GraniteMoeSharedForCausalLM
from worker_service.models.granite_moe import GraniteMoeForCausalLM
from worker_service.models.hunyuan import HunYuanDenseV1ForCausalLM
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.minimax_m2 import MiniMaxM2ForCausalLM
from worker_service.models.mistral import MistralForCausalLM
from worker_service.models.mixtral import MixtralForCausalLM
from worker_service.models.olmo2 import Olmo2ForCausalLM
from worker_service.models.olmo3 import Olmo3ForCausalLM
from worker_service.models.olmoe import OlmoeForCausalLM
from worker_service.models.phi3 import Phi3ForCausalLM
from worker_service.models.qwen2 import Qwen2ForCausalLM
from worker_service.models.qwen2_moe import Qwen2MoeForCausalLM
from worker_service.models.qwen3 import Qwen3ForCausalLM
from worker_service.models.qwen3_moe import Qwen3MoeForCausalLM
from worker_service.models.seed_oss import SeedOssForCausalLM
from worker_service.models.smollm3 import SmolLM3ForCausalLM
from worker_service.unsupported import UnsupportedModel

# Exactly radixserve.architectures.SUPPORTED_ARCHITECTURES (which the launcher checks folders against).
MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "SeedOssForCausalLM": SeedOssForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": Cohere2ForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeSharedForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "AfmoeForCausalLM": AfmoeForCausalLM,
    "Dots1ForCausalLM": Dots1ForCausalLM,
    "HunYuanDenseV1ForCausalLM": HunYuanDenseV1ForCausalLM,
    "ApertusForCausalLM": ApertusForCausalLM,
}


def model_class(config: Any) -> type[CausalLM]:
    """The class for the first of `config.architectures` we have; `UnsupportedModel` (one line,
    naming them and what we support) where we have none."""
    architectures = getattr(config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    raise UnsupportedModel(unsupported(architectures))
