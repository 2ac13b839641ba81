"""The torch the image installs: its version (pyproject.toml's pin) and a check of the build.

    python torch_build.py pin pyproject.toml              prints the pinned version, e.g. 2.13.0
    python torch_build.py check --version 2.13.0 --variant cpu

The Dockerfile reads the version with `pin`, so it is written in one place, and runs `check`
right after installing torch, so that a wrong build fails the image build instead of shipping.
pip can install a different build than asked without a word: a CUDA wheel from PyPI when the
CPU index is unreachable or lacks the version, or a CPU wheel on the CUDA image. `check` imports
the installed torch and fails (exit 1, one line saying what is wrong) unless it is the pinned
version and the requested variant: `cpu` (no CUDA or ROCm runtime, no `nvidia-*` packages) or
`cuXYZ` (the CUDA X.Y build, e.g. cu128 = CUDA 12.8). Standard library only: it runs before
anything but torch is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType

CPU_VARIANT = "cpu"
CUDA_VARIANT = re.compile(r"^cu(\d+)(\d)$")  # cu128 -> CUDA 12.8, cu130 -> CUDA 13.0
TORCH_PIN = re.compile(r"^torch\s*==\s*([^\s;,]+)\s*$")
# Distributions that only a CUDA build pulls in (the multi-GB part of the PyPI wheel).
CUDA_DISTRIBUTION_PREFIX = "nvidia-"


def pinned_version(pyproject: Path) -> str:
    """The version of the `torch==X` requirement in pyproject.toml's dependencies."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = [m.group(1) for d in dependencies if (m := TORCH_PIN.match(d.strip()))]
    if len(pins) != 1:
        raise ValueError(f"{pyproject}: want exactly one `torch==X` dependency, found {len(pins)}")
    return pins[0]


def expected_cuda(variant: str) -> str | None:
    """The CUDA version a variant's torch reports (`torch.version.cuda`); None for cpu."""
    if variant == CPU_VARIANT:
        return None
    match = CUDA_VARIANT.match(variant)
    if match is None:
        raise ValueError(f"unknown torch variant {variant!r}: use {CPU_VARIANT!r} or cuXYZ (cu128)")
    return f"{int(match.group(1))}.{match.group(2)}"


def build_errors(torch: ModuleType, version: str, variant: str,
                 distributions: list[str]) -> list[str]:
    """What is wrong with the imported `torch` for the wanted version and variant."""
    errors: list[str] = []
    installed = str(getattr(torch, "__version__", "?"))
    if installed.split("+", 1)[0] != version:
        errors.append(f"torch {installed} is installed, not the pinned {version}")
    cuda = getattr(torch.version, "cuda", None)
    hip = getattr(torch.version, "hip", None)
    want_cuda = expected_cuda(variant)
    if want_cuda is None:
        if cuda or hip:
            errors.append(f"torch {installed} is a {'CUDA ' + cuda if cuda else 'ROCm ' + hip} "
                          f"build, but the image asked for the CPU build")
        cuda_packages = sorted(d for d in distributions if d.startswith(CUDA_DISTRIBUTION_PREFIX))
        if cuda_packages:
            errors.append(f"CUDA packages are installed on the CPU image: {', '.join(cuda_packages)}")
    elif cuda != want_cuda:
        built = f"CUDA {cuda}" if cuda else ("ROCm " + hip if hip else "CPU")
        errors.append(f"torch {installed} is a {built} build, but the image asked for "
                      f"{variant} (CUDA {want_cuda})")
    return errors


def installed_distributions() -> list[str]:
    return sorted({(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pin = commands.add_parser("pin", help="print pyproject.toml's torch version")
    pin.add_argument("pyproject", type=Path)
    check = commands.add_parser("check", help="fail unless the installed torch is the wanted build")
    check.add_argument("--version", required=True, help="the pinned torch version, e.g. 2.13.0")
    check.add_argument("--variant", required=True, help=f"{CPU_VARIANT} or cuXYZ, e.g. cu128")
    args = parser.parse_args(argv)
    if args.command == "pin":
        print(pinned_version(args.pyproject))
        return 0
    try:
        expected_cuda(args.variant)
        import torch
    except (ValueError, ImportError) as exc:
        print(f"torch check: {exc}", file=sys.stderr)
        return 1
    errors = build_errors(torch, args.version, args.variant, installed_distributions())
    for error in errors:
        print(f"torch check: {error}", file=sys.stderr)
    if errors:
        return 1
    print(f"torch check: torch {torch.__version__} is the {args.variant} build", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
