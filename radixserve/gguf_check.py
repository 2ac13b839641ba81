"""Why a GGUF file cannot be read, as one line (None: it can).

Two depths, read with the `gguf` package's own reader and constants (no second parser):
- `gguf_header_problem` reads the first 8 bytes (magic and version): cheap enough for
  `radixserve up` to check before it starts anything. It catches an empty file, a file that is
  not GGUF (random bytes, a safetensors file renamed) and a version the reader does not take.
- `gguf_problem` reads the whole metadata with `GGUFReader` and checks that every tensor's data
  lies inside the file, so a file cut short says so instead of failing in a reshape, and names an
  architecture not served from GGUF files. Reading the
  metadata of a large vocabulary takes seconds: it runs only where loading the file has failed
  already (`model_source`), to say why.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

# Magic (uint32) and version (uint32): what the header check reads.
HEADER_BYTES = 8
ARCHITECTURE_KEY = "general.architecture"
# The architectures (llama.cpp's names) served from GGUF files: `model_source.GGUF_ARCHITECTURES`'
# (Mixtral is written as `llama`). Another one's file may fail in transformers' own reading of it
# (gpt-oss's, with transformers 5.24), which is then said in these terms.
SERVED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "phi3", "gemma2", "gemma3")


class Truncated(ValueError):
    """The file ends before its tensor data does."""


def gguf_header_problem(path: Path) -> str | None:
    """The file is empty, not GGUF, or of a version the reader does not take (reads 8 bytes)."""
    try:
        with open(path, "rb") as file:
            header = file.read(HEADER_BYTES)
    except OSError as exc:
        return f"it cannot be opened: {exc.strerror or exc}"
    if not header:
        return "the file is empty"
    if len(header) < HEADER_BYTES:
        return f"the file has only {len(header)} bytes, less than a GGUF header"
    magic, version = np.frombuffer(header, dtype="<u4")
    if magic != GGUF_MAGIC:
        return f"it is not a GGUF file (it starts with {header[:4]!r}, not b'GGUF')"
    if version not in READER_SUPPORTED_VERSIONS and version.byteswap() not in READER_SUPPORTED_VERSIONS:
        return f"GGUF version {version} is not supported (the reader takes {list(READER_SUPPORTED_VERSIONS)})"
    return None


def gguf_problem(path: Path) -> str | None:
    """Anything `gguf_header_problem` finds, or what reading the metadata and checking the
    tensors' extent finds (seconds on a large vocabulary: for the failure path)."""
    problem = gguf_header_problem(path)
    if problem is not None:
        return problem
    try:
        reader = _ExtentCheckingReader(path)
    except Truncated as exc:
        return str(exc)
    except Exception as exc:  # the reader's own complaint (bad metadata, unknown type, ...)
        text = str(exc).strip().splitlines()
        return (f"its metadata cannot be read, the file ({os.path.getsize(path)} bytes) may be cut short "
                f"({type(exc).__name__}: {text[0] if text else ''})")
    field = reader.fields.get(ARCHITECTURE_KEY)
    architecture = None if field is None else str(field.contents())
    if architecture is not None and architecture not in SERVED_ARCHITECTURES:
        return (f"its architecture {architecture!r} is not served from GGUF files (served: "
                f"{', '.join(SERVED_ARCHITECTURES)}); serve the model's safetensors checkpoint instead")
    return None


class _ExtentCheckingReader(GGUFReader):
    """`GGUFReader` that compares the tensors' extent with the file size before it maps them."""

    def _build_tensors(self, start_offs: int, fields) -> None:
        end = 0
        for field in fields:
            _name_len, _name, _n_dims, dims, raw_dtype, offset = field.parts
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
            num_bytes = int(np.prod(dims, dtype=np.uint64)) * type_size // block_size
            end = max(end, int(start_offs) + int(offset[0]) + num_bytes)
        size = os.path.getsize(self.data.filename)
        if end > size:
            raise Truncated(f"the file is cut short: it has {size} bytes, its tensor data ends at byte {end}")
        super()._build_tensors(start_offs, fields)
