"""Offline checks of the Dockerfile and .dockerignore (no container engine here).

`dockerfile_errors` reads the instructions and checks what the image must do: the pinned
torch of pyproject.toml, protos generated before the project is installed, a non-root user
and a service command. `context_files` applies .dockerignore the way the builder does (for the
pattern forms we use) so a test can see which files reach the build.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

SERVICE_COMMANDS = (
    ["python", "-m", "worker_service"],
    ["python", "-m", "router_service"],
    ["python", "-m", "gateway_service"],
    ["radixserve", "up"],
)


@dataclass(slots=True, frozen=True)
class Instruction:
    keyword: str
    text: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order, with `\\` continuations joined and comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        instructions.append(Instruction(keyword.upper(), rest.strip()))
    return instructions


def _args(instructions: list[Instruction]) -> dict[str, str]:
    found: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ARG" and "=" in ins.text:
            name, _, value = ins.text.partition("=")
            found[name.strip()] = value.strip()
    return found


def pinned_torch(pyproject: Path) -> str:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pin = next(d for d in deps if re.match(r"^torch\s*==", d))
    return pin.split("==", 1)[1].strip()


def _first(instructions: list[Instruction], keyword: str,
           pattern: re.Pattern[str]) -> tuple[int, int] | None:
    for index, ins in enumerate(instructions):
        match = pattern.search(ins.text) if ins.keyword == keyword else None
        if match:
            return index, match.start()
    return None


def dockerfile_errors(text: str, pyproject: Path) -> list[str]:
    instructions = parse_dockerfile(text)
    args = _args(instructions)
    errors: list[str] = []
    froms = [i.text for i in instructions if i.keyword == "FROM"]
    base = froms[0].replace("${PYTHON_IMAGE}", args.get("PYTHON_IMAGE", "")) if froms else ""
    if base != "python:3.11-slim":
        errors.append(f"base image is {base!r}, not python:3.11-slim")
    if args.get("TORCH_VERSION") != pinned_torch(pyproject):
        errors.append(f"TORCH_VERSION {args.get('TORCH_VERSION')} is not pyproject's torch pin")
    runs = [i.text for i in instructions if i.keyword == "RUN"]
    if not any("torch==${TORCH_VERSION}" in run for run in runs):
        errors.append("no RUN installs torch==${TORCH_VERSION}")
    # (instruction index, offset in its text): where the sources arrive, where the protobuf
    # code is generated and where the project is installed, which must come in that order.
    copy_all = _first(instructions, "COPY", re.compile(r"^\.\s+\.$"))
    generate = _first(instructions, "RUN", re.compile(r"radixserve\.gen_protos"))
    install = _first(instructions, "RUN", re.compile(r"pip install (--no-deps )?\.(\s|\[|$)"))
    if copy_all is None or generate is None or install is None:
        errors.append("the image must copy the sources, run gen_protos and install the project")
    elif not copy_all < generate < install:
        errors.append("protos must be generated after the sources are copied, before installing")
    users = [i.text for i in instructions if i.keyword == "USER"]
    if not users or users[-1].split(":")[0] in {"root", "0"}:
        errors.append("the image must end with a non-root USER")
    elif users[-1].startswith("${") and args.get(users[-1][2:-1]) in {None, "0"}:
        errors.append(f"USER {users[-1]} is not a non-root id")
    cmds = [i.text for i in instructions if i.keyword == "CMD"]
    if not cmds:
        command: list[str] = []
    elif cmds[-1].startswith("["):
        command = json.loads(cmds[-1])  # exec form
    else:
        command = shlex.split(cmds[-1])
    if not any(command[:len(c)] == c for c in SERVICE_COMMANDS):
        errors.append(f"CMD {command} starts no radixserve service")
    return errors


def dockerignore_patterns(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def is_ignored(relative: str, patterns: list[str]) -> bool:
    """A path is left out when it or a parent folder matches a pattern (last match wins)."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        if body.startswith("**/"):
            # `**/x` matches x at any depth: compare against every tail of the path.
            tails = ["/".join(parts[n:m]) for n in range(len(parts))
                     for m in range(n + 1, len(parts) + 1)]
            hit = any(fnmatch.fnmatchcase(t, body[3:]) for t in tails)
        else:
            hit = any(fnmatch.fnmatchcase(p, body) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


def context_files(root: Path, patterns: list[str]) -> set[str]:
    """Files under `root` that a build with these .dockerignore patterns would receive."""
    kept: set[str] = set()
    for folder, dirs, files in os.walk(root):
        rel_folder = os.path.relpath(folder, root)
        rel = "" if rel_folder == "." else rel_folder + "/"
        dirs[:] = [d for d in dirs if not is_ignored(rel + d, patterns)]
        kept |= {rel + f for f in files if not is_ignored(rel + f, patterns)}
    return kept
