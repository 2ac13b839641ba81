"""Offline checks of the Dockerfile and .dockerignore (no container engine here).

`dockerfile_errors` reads the instructions and checks what the image must do: build with the
classic builder as well as BuildKit (no `# syntax=` frontend to fetch, no BuildKit-only flags),
torch at pyproject.toml's pin read from there (not written again), from the torch index alone
and checked after every install, protos generated before the project is installed, a non-root
user and a service command. `context_files` applies .dockerignore the way the builder does (for
the pattern forms we use) so a test can see which files reach the build.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

SERVICE_COMMANDS = (
    ["python", "-m", "worker_service"],
    ["python", "-m", "router_service"],
    ["python", "-m", "gateway_service"],
    ["radixserve", "up"],
)
BASE_IMAGE = "python:3.11-slim"
TORCH_BUILD_SCRIPT = "torch_build.py"
# Parser directives that make BuildKit fetch a frontend image (`syntax`) or exist only there.
BUILDKIT_DIRECTIVES = {"syntax", "check"}
# Instruction flags the classic builder does not know.
BUILDKIT_FLAGS = {
    "RUN": ("--mount", "--network", "--security"),
    "COPY": ("--link", "--chmod", "--parents", "--exclude"),
    "ADD": ("--link", "--chmod", "--checksum", "--keep-git-dir", "--exclude"),
}
HEREDOC = re.compile(r"<<-?\s*[\"']?[A-Za-z_]+")


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


def _last(instructions: list[Instruction], keyword: str,
          pattern: re.Pattern[str]) -> tuple[int, int] | None:
    found = None
    for index, ins in enumerate(instructions):
        if ins.keyword == keyword:
            for match in pattern.finditer(ins.text):
                found = (index, match.start())
    return found


def _first(instructions: list[Instruction], keyword: str,
           pattern: re.Pattern[str]) -> tuple[int, int] | None:
    for index, ins in enumerate(instructions):
        match = pattern.search(ins.text) if ins.keyword == keyword else None
        if match:
            return index, match.start()
    return None


def parser_directives(text: str) -> dict[str, str]:
    """`# name=value` lines at the very top of a Dockerfile (before any other line)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = re.match(r"^#\s*([A-Za-z]+)\s*=\s*(\S.*?)\s*$", line)
        if match is None:
            break
        found[match.group(1).lower()] = match.group(2)
    return found


def classic_builder_errors(text: str, instructions: list[Instruction]) -> list[str]:
    """What only BuildKit understands: such a file fails offline or on the classic builder."""
    errors = [f"parser directive `# {name}=` needs BuildKit (a `syntax` line fetches a frontend "
              f"image from Docker Hub at every build)"
              for name in parser_directives(text) if name in BUILDKIT_DIRECTIVES]
    for ins in instructions:
        for flag in BUILDKIT_FLAGS.get(ins.keyword, ()):
            if re.search(rf"(^|\s){re.escape(flag)}(=|\s)", ins.text):
                errors.append(f"{ins.keyword} {flag} needs BuildKit")
        if ins.keyword in BUILDKIT_FLAGS and HEREDOC.search(ins.text):
            errors.append(f"{ins.keyword} with a heredoc needs BuildKit")
    return errors


def torch_errors(instructions: list[Instruction]) -> list[str]:
    """torch: pyproject's pin read at build time, one index, the build checked after installs."""
    errors: list[str] = []
    for ins in instructions:
        if ins.keyword in {"ARG", "ENV"} and re.match(r"^TORCH_VERSION\b", ins.text):
            errors.append(f"{ins.keyword} {ins.text}: the torch version is written twice; "
                          f"read pyproject.toml's pin instead")
    runs = [i.text for i in instructions if i.keyword == "RUN"]
    if not any(f"{TORCH_BUILD_SCRIPT} pin" in run and "pyproject.toml" in run for run in runs):
        errors.append(f"no RUN reads the torch version from pyproject.toml ({TORCH_BUILD_SCRIPT} pin)")
    installs = [run for run in runs if re.search(r"pip install\b.*\btorch==", run)]
    if not installs:
        errors.append("no RUN installs torch")
    for run in installs:
        if re.search(r"torch==\d", run):
            errors.append("the torch version is written in the Dockerfile: read pyproject.toml's pin")
        if "--extra-index-url" in run:
            errors.append("torch is installed with --extra-index-url: pip may take another build "
                          "from the extra index without a word")
        if "--index-url" not in run:
            errors.append("torch is not installed from the torch index (--index-url)")
    last_install = _last(instructions, "RUN", re.compile(r"pip install\b"))
    last_check = _last(instructions, "RUN", re.compile(rf"{re.escape(TORCH_BUILD_SCRIPT)} check\b"))
    if last_check is None or (last_install is not None and last_check < last_install):
        errors.append(f"the installed torch build is not checked ({TORCH_BUILD_SCRIPT} check) "
                      f"after the last pip install")
    return errors


def dockerfile_errors(text: str) -> list[str]:
    instructions = parse_dockerfile(text)
    args = _args(instructions)
    errors = classic_builder_errors(text, instructions)
    for base in (i.text.split()[0] for i in instructions if i.keyword == "FROM"):
        base = base.replace("${PYTHON_IMAGE}", args.get("PYTHON_IMAGE", ""))
        if base != BASE_IMAGE:
            errors.append(f"base image is {base!r}, not {BASE_IMAGE}")
    if not any(i.keyword == "FROM" for i in instructions):
        errors.append("no FROM")
    errors += torch_errors(instructions)
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
