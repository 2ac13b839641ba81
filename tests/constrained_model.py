"""A tiny random Llama that speaks SmolLM2's vocabulary, for constrained-decoding tests.

Constraints are compiled against a real tokenizer, so the model carries SmolLM2's tokenizer and
chat template (vocab 49152, EOS 2 = <|im_end|>); its weights are random and tiny, so a forward
pass costs next to nothing and sampled outputs wander over the whole vocabulary: the masks, not
the model, keep the outputs valid.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from worker.tiny_models import make_tiny_llama

SMOLLM2_VOCAB_SIZE = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def with_smollm2_tokenizer(out_dir: Path, smollm2_dir: Path) -> Path:
    """`out_dir` (a checkpoint over SmolLM2's vocabulary) given SmolLM2's tokenizer and template."""
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, out_dir / name)
    return out_dir


def make_constrained_model(out_dir: Path, smollm2_dir: Path, **overrides) -> Path:
    """`overrides`: LlamaConfig settings (a larger `initializer_range` makes peaked outputs)."""
    make_tiny_llama(out_dir, vocab_size=SMOLLM2_VOCAB_SIZE, **overrides)
    return with_smollm2_tokenizer(out_dir, smollm2_dir)
