"""Where a model's files are: a Hugging Face folder, or one GGUF file (given itself, or the only
`.gguf` in a folder without `config.json`).

Every service that reads the model (the gateway's tokenizer, the worker's config, weights and
tokenizer) resolves `--model` here once, so a GGUF file is served as it is everywhere: its config,
tokenizer and chat template come from its metadata (transformers reads them with `gguf_file=`).
transformers is imported only inside the functions that need it: the router imports none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

GGUF_SUFFIX = ".gguf"
HF_CONFIG = "config.json"
# Our model class for each GGUF architecture we serve (the file names no `architectures`).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                      "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


class ModelNotFound(ValueError):
    """`--model` names neither a model folder nor a GGUF file (the message says which and why)."""


class ModelUnreadable(ValueError):
    """The model's files are there but cannot be read (a GGUF file that is empty, not GGUF, or
    cut short; a folder whose config or tokenizer is custom code): one line naming the file and
    the cause."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model folder, and the GGUF file in it that holds the model (None: a Hugging Face folder)."""

    folder: Path
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> Path | None:
        return None if self.gguf_file is None else self.folder / self.gguf_file

    @property
    def name(self) -> str:
        """The served model's name: the folder's, or the GGUF file's without its suffix."""
        return self.folder.name if self.gguf_file is None else self.gguf_file.removesuffix(GGUF_SUFFIX)

    def hf_kwargs(self) -> dict[str, Any]:
        """What `from_pretrained(self.folder, ...)` needs to read this model. Never a model's own
        code: a folder that names some (`auto_map`) is refused at once, not after a prompt."""
        return {"trust_remote_code": False, **({} if self.gguf_file is None else {"gguf_file": self.gguf_file})}


def resolve_model(path: str | Path) -> ModelSource:
    """`path` as a `ModelSource`; `ModelNotFound` (one line) where it is neither."""
    path = Path(path)
    if path.is_file():
        if path.suffix != GGUF_SUFFIX:
            raise ModelNotFound(f"{path} is a file but not a {GGUF_SUFFIX} file")
        return ModelSource(path.parent, path.name)
    if not path.is_dir():
        raise ModelNotFound(f"{path} is not a folder or a {GGUF_SUFFIX} file (it does not exist)")
    if (path / HF_CONFIG).is_file():
        return ModelSource(path)
    found = sorted(p.name for p in path.glob(f"*{GGUF_SUFFIX}") if p.is_file())
    if len(found) == 1:
        return ModelSource(path, found[0])
    if found:
        raise ModelNotFound(f"{path} holds several GGUF files ({', '.join(found)}): name one")
    raise ModelNotFound(f"{path} has no {HF_CONFIG} and no {GGUF_SUFFIX} file")


def load_tokenizer(source: ModelSource):
    """The model's Hugging Face tokenizer (with its chat template); `ModelUnreadable` for a GGUF
    file that cannot be read."""
    from transformers import AutoTokenizer  # heavy import, done once at startup

    return _reading(source, lambda: AutoTokenizer.from_pretrained(str(source.folder), **source.hf_kwargs()))


def load_config(source: ModelSource) -> Any:
    """The model's transformers config; a GGUF file's names the architecture we serve it with
    (`GGUF_ARCHITECTURES`; an architecture we lack keeps none, and the worker says so).
    `ModelUnreadable` for a GGUF file that cannot be read."""
    from transformers import AutoConfig

    config = _reading(source, lambda: AutoConfig.from_pretrained(str(source.folder), **source.hf_kwargs()))
    if source.gguf_file is not None and not getattr(config, "architectures", None):
        architecture = GGUF_ARCHITECTURES.get(config.model_type)
        config.architectures = [architecture] if architecture else [f"gguf:{config.model_type}"]
    return config


Loaded = TypeVar("Loaded")


def _reading(source: ModelSource, load: Callable[[], Loaded]) -> Loaded:
    """`load()`, where a GGUF file that fails to load becomes `ModelUnreadable` saying why (its
    first line: transformers' and gguf's own messages are tracebacks' last lines)."""
    path = source.gguf_path
    if path is None:
        try:
            return load()
        except ValueError as exc:
            if "trust_remote_code" not in str(exc):
                raise
            raise ModelUnreadable(f"{source.folder} names code of its own for transformers to run (auto_map: a "
                                  "model_type or tokenizer transformers lacks), which is never run here") from exc
    try:
        return load()
    except Exception as exc:
        from radixserve.gguf_check import gguf_problem  # the gguf package, only on this path

        first_line = next(iter(str(exc).strip().splitlines()), "")
        cause = gguf_problem(path) or f"{type(exc).__name__}: {first_line}"
        raise ModelUnreadable(f"cannot read the GGUF file {path}: {cause}") from exc
