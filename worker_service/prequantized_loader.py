"""Fill a model from a pre-quantized GPTQ or AWQ safetensors checkpoint, keeping its int4 weights
(or an MXFP4 one, GPT-OSS's, keeping its experts as int8: `quant/mxfp4.py`).

A linear layer whose checkpoint projections come as `<name>.qweight` (with `.qzeros`, `.scales`
and GPTQ's `.g_idx`) in place of `<name>.weight` becomes `QuantizedWeight`s
(`quant/prequantized.py`), this rank's rows and columns of them (columns on whole groups:
`QuantizedWeight.cols`), handed to the layer to pack as they are
(`PackableLinear.checkpoint_quantized`). Every other parameter (norms, embeddings, the LM head,
layers the checkpoint left unquantized, biases) is read as `loader.py` reads a plain checkpoint.
A layer's packed tensors are read whole (a 4-bit layer is an eighth of its float32 bytes) and
then cut to the rank's shard.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from worker_service.layers.linear import PackableLinear
from worker_service.layers.weights import WeightSlice
from worker_service.loader import bounds, checkpoint_files, load_weights
from worker_service.quant import mxfp4
from worker_service.quant.format import QuantizedWeight, merge_row_blocks, num_groups
from worker_service.quant.prequantized import MXFP4, PrequantizedScheme, awq_weight, gptq_weight
from worker_service.unsupported import UnsupportedModel

log = logging.getLogger(__name__)

WEIGHT_SUFFIX = ".weight"


class PackedTensors:
    """The checkpoint's packed layers by their (unquantized) weight names, read a slice at a time."""

    def __init__(self, model_dir: Path, scheme: PrequantizedScheme, stack: ExitStack) -> None:
        self.files = checkpoint_files(model_dir)
        self.scheme = scheme
        self._stack = stack
        self._handles: dict[Path, object] = {}

    def _base(self, piece: WeightSlice) -> str | None:
        return piece.name[: -len(WEIGHT_SUFFIX)] if piece.name.endswith(WEIGHT_SUFFIX) else None

    def is_packed(self, piece: WeightSlice) -> bool:
        if self.scheme.method == MXFP4:
            return f"{piece.name}_blocks" in self.files
        base = self._base(piece)
        return base is not None and f"{base}.qweight" in self.files

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._handles[path]

    def _read(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def _mxfp4(self, piece: WeightSlice) -> QuantizedWeight:
        """This rank's rows and whole groups of columns of an MXFP4 tensor (an expert's, where the
        piece names one), read as such; its blocks are `[out, in]` whatever the plain tensor's."""
        blocks = self._handle(f"{piece.name}_blocks").get_slice(f"{piece.name}_blocks")
        in_features = blocks.get_shape()[-2] * mxfp4.GROUP
        cols = piece.cols or range(in_features)
        if cols.start % mxfp4.GROUP or (cols.stop % mxfp4.GROUP and cols.stop != in_features):
            raise UnsupportedModel(f"mxfp4: columns {cols.start}..{cols.stop} of {piece.name} cut its groups "
                                   f"of {mxfp4.GROUP}")
        lead = () if piece.expert is None else (piece.expert,)
        groups = slice(cols.start // mxfp4.GROUP, num_groups(cols.stop, mxfp4.GROUP))
        scales = self._handle(f"{piece.name}_scales").get_slice(f"{piece.name}_scales")
        selection = lead + (bounds(piece.rows), groups)
        return mxfp4.mxfp4_weight(blocks[selection], scales[selection], len(cols))

    def quantized(self, piece: WeightSlice) -> QuantizedWeight:
        if self.scheme.method == MXFP4:
            return self._mxfp4(piece)
        base = self._base(piece)
        qweight, qzeros, scales = (self._read(f"{base}.{part}") for part in ("qweight", "qzeros", "scales"))
        if self.scheme.method == "gptq":
            g_idx = self._read(f"{base}.g_idx") if f"{base}.g_idx" in self.files else None
            weight = gptq_weight(self.scheme, qweight, qzeros, scales, g_idx)
        else:
            weight = awq_weight(self.scheme, qweight, qzeros, scales)
        if piece.rows is not None:
            weight = weight.rows(piece.rows)
        return weight if piece.cols is None else weight.cols(piece.cols)


@torch.inference_mode()
def load_prequantized_weights(model: torch.nn.Module, model_dir: Path, scheme: PrequantizedScheme) -> str:
    """Fill `model` from the checkpoint in `model_dir` (module doc). Returns how the
    quantization is reported (`PrequantizedScheme.served_name`)."""
    kept: set[int] = set()
    num_layers = 0
    with ExitStack() as stack:
        tensors = PackedTensors(model_dir, scheme, stack)
        for module in model.modules():
            if not isinstance(module, PackableLinear) or module.packed is not None:
                continue
            pieces = getattr(module.weight, "weight_slices", None) or []
            packed = [tensors.is_packed(piece) for piece in pieces]
            if not any(packed):
                continue
            if not all(packed):
                names = [piece.name for piece in pieces]
                raise ValueError(f"{scheme.method}: {names} are merged into one layer but only some are quantized")
            module.checkpoint_quantized = merge_row_blocks([tensors.quantized(piece) for piece in pieces])
            kept.add(id(module.weight))
            num_layers += 1
    load_weights(model, model_dir, skip=kept)
    log.info("%s: %d linear layers kept as %s", model_dir.name, num_layers, scheme.served_name)
    return scheme.served_name
