"""Random weights in the shape of a real checkpoint, for machines its weights cannot reach.

    python tests/gpu/random_checkpoint.py FOLDER

FOLDER holds a checkpoint's config.json and tokenizer files (a `make model` folder without its
model.safetensors, copied to a lent GPU machine); this writes model.safetensors there with
transformers' own initialisation of that architecture, seeded. `initializer_range` is raised from
0.02 to INIT_STD: at 0.02 a random SmolLM2 repeats one token forever, which would let a greedy
comparison pass while most of the model was wrong; at 0.05 every step picks a different token.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

INIT_STD = 0.05
SEED = 0


def write_random_weights(folder: Path) -> None:
    config = AutoConfig.from_pretrained(folder)
    config.initializer_range = INIT_STD
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    write_random_weights(parser.parse_args().folder)


if __name__ == "__main__":
    main()
