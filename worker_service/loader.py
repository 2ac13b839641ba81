"""Fill a model's parameters from safetensors files, reading only this rank's slices.

Every parameter carries `weight_slices` (see `layers/weights.py`). Each slice is read with
`safe_open(...).get_slice(name)[rows, cols]`, which reads just those bytes from the file, so a
rank never holds more than its own shard (plus one slice in flight).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from radixserve.model_source import ModelUnreadable
from worker_service.layers.weights import WeightSlice

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
    with safe_open(single, framework="pt") as handle:
        return {name: single for name in handle.keys()}


def bounds(selection: range | None) -> slice:
    """A `WeightSlice`'s rows or columns (None: all) as a slice, its step kept."""
    return slice(None) if selection is None else slice(selection.start, selection.stop, selection.step)


def read_slice(handle, piece: WeightSlice) -> torch.Tensor:
    tensor_slice = handle.get_slice(piece.name)
    if not tensor_slice.get_shape():  # a scalar (Apertus' xIELU beta and eps): read whole
        return handle.get_tensor(piece.name)
    lead = () if piece.expert is None else (piece.expert,)
    if len(tensor_slice.get_shape()) - len(lead) == 1:
        return tensor_slice[lead + (bounds(piece.rows),)]
    if piece.transposed:
        return tensor_slice[lead + (bounds(piece.cols), bounds(piece.rows))].T.contiguous()
    return tensor_slice[lead + (bounds(piece.rows), bounds(piece.cols))]


@torch.inference_mode()
def load_weights(model: torch.nn.Module, model_dir: Path, skip: set[int] | None = None) -> None:
    """Copy every parameter's slices into it, but those whose `id` is in `skip` (read by another
    loader); `ModelUnreadable` names a tensor the checkpoint lacks or holds in another shape."""
    files = checkpoint_files(model_dir)
    with ExitStack() as stack:
        handles = {}
        for param in model.parameters():  # tied parameters appear once
            if skip and id(param) in skip:
                continue
            pieces = getattr(param, "weight_slices", None)
            if pieces is None:
                raise ValueError(f"parameter of shape {tuple(param.shape)} has no weight_slices")
            parts = []
            for piece in pieces:
                if piece.name not in files:
                    raise ModelUnreadable(f"{piece.name} is not in the checkpoint at {model_dir}")
                path = files[piece.name]
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(path, framework="pt"))
                parts.append(read_slice(handles[path], piece))
            values = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if values.shape != param.shape:
                raise ModelUnreadable(f"{pieces[0].name}: read {tuple(values.shape)}, expected {tuple(param.shape)} "
                                      f"(the checkpoint at {model_dir} does not fit its config.json)")
            param.copy_(values)
