"""Paged attention over the KV pool (see `paged.py`), with prefix-aware decode (`cascade.py`)."""

from worker_service.attention.cascade import CascadeDecode
from worker_service.attention.decode_plan import DecodePlan, plan_decode
from worker_service.attention.kernels import GatherSpace
from worker_service.attention.masks import additive_mask
from worker_service.attention.paged import AttentionBatch, PrefillSpan, paged_attention

__all__ = ["AttentionBatch", "CascadeDecode", "DecodePlan", "GatherSpace", "PrefillSpan", "additive_mask", "paged_attention", "plan_decode"]
