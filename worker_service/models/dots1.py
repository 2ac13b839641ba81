"""dots.llm1 (`Dots1ForCausalLM`): Qwen3's attention (per-head q/k norms; sliding-window layers by
`layer_types`) with DeepSeek-V3's experts and routing (`deepseek.DeepseekV3MoE`: sigmoid scores with
a correction bias over groups, renormalised where `norm_topk_prob`, scaled, plus shared experts)
after `first_k_dense_replace` dense layers. No fusable layer.
"""

from __future__ import annotations

from worker_service.models.deepseek import DeepseekV3MoE, dense_until
from worker_service.models.moe import RoutesExperts
from worker_service.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM


class Dots1DecoderLayer(Qwen3DecoderLayer):
    mlp_class = dense_until(DeepseekV3MoE)


class Dots1ForCausalLM(RoutesExperts, Qwen3ForCausalLM):
    """Checkpoint names follow Hugging Face's `Dots1ForCausalLM` (experts one by one)."""

    fusable_layer = None
    layer_class = Dots1DecoderLayer
