"""Building, caching and loading the compiled kernels' library (`worker_service/csrc/`).

It is built with the machine's C++ compiler (`$CXX`, else `g++`) for the machine's own CPU
(`-march=native`, AVX-512 required) into a cache folder keyed by the sources, the compiler and
the CPU's flags, so a worker rebuilds only when one of them changed, and loaded with ctypes. It
uses torch's OpenMP runtime (the same `libgomp.so.1`, already loaded) with torch's thread count.
Where it cannot be built (no compiler, no AVX-512), `load()` returns None and `failure()` says
why; the backend selection (`worker_service.backends`) then takes another backend.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from worker_service.native.signatures import bind


CSRC = Path(__file__).parent.parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "elementwise.cpp", CSRC / "rope_store.cpp", CSRC / "gemv.cpp",
           CSRC / "decode_layer.cpp", CSRC / "sample.cpp",
           CSRC / "penalties.cpp", CSRC / "logprobs.cpp"]  # headers beside them are included
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
COMPILE_TIMEOUT_S = 300.0


def cache_dir() -> Path:
    """Where built kernels are kept: `$RADIXSERVE_KERNEL_CACHE`, else the user's cache folder, else /tmp."""
    configured = os.environ.get("RADIXSERVE_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = base / "radixserve" / "kernels"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"radixserve-kernels-{os.getuid()}"


def cpu_flags() -> str:
    """The CPU's feature flags line from /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build(compiler: str | None = None, sources: list[Path] | None = None, name: str = "radixserve-kernels",
          flags: list[str] | None = None) -> Path:
    """The library `name` from `sources` (default: the AVX-512 kernels, `SOURCES`, with
    `COMPILE_FLAGS`), compiled now unless this machine has it cached. Raises RuntimeError on failure."""
    sources = SOURCES if sources is None else sources
    flags = COMPILE_FLAGS if flags is None else flags
    compiler = compiler or os.environ.get("CXX") or "g++"
    path = shutil.which(compiler)
    if path is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} not found; set CXX)")
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([*(source.read_text() for source in sorted(CSRC.iterdir())), version,
                                     " ".join(flags), cpu_flags()])
                         .encode()).hexdigest()[:16]
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / f"{name}-{key}.so"
    if library.is_file():
        return library
    # Build beside the target and rename: workers that start together each build, and each
    # rename is atomic, so none loads a half-written file.
    partial = folder / f".{name}-{key}-{os.getpid()}.so"
    result = subprocess.run([path, *flags, *map(str, sources), "-o", str(partial)],
                            capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"compiling the kernels failed: {result.stderr.strip()[-2000:]}")
    os.replace(partial, library)
    return library


Kernels = TypeVar("Kernels")


class LazyLibrary(Generic[Kernels]):
    """A library of its own (`sources` built with `flags` as `name`), built and wrapped by `wrap`
    on the first `load()`; None where it cannot be (a CPU without `required_cpu_flags`, no
    compiler, a failed build), and then `failure()` says why."""

    def __init__(self, name: str, sources: list[Path], flags: list[str], required_cpu_flags: tuple[str, ...],
                 wrap: Callable[[Path], Kernels]) -> None:
        self.name, self.sources, self.flags = name, sources, flags
        self.required_cpu_flags, self.wrap = required_cpu_flags, wrap
        self._loaded: Kernels | None = None
        self._failure: str | None = None

    def load(self) -> Kernels | None:
        if self._loaded is None and self._failure is None:
            flags = cpu_flags().split()
            missing = [flag for flag in self.required_cpu_flags if flag not in flags]
            if missing:
                self._failure = f"this CPU lacks {', '.join(missing)}"
                return None
            try:
                self._loaded = self.wrap(build(sources=self.sources, name=self.name, flags=self.flags))
            except (RuntimeError, OSError, subprocess.SubprocessError) as error:
                self._failure = str(error)
        return self._loaded

    def failure(self) -> str | None:
        """Why `load()` returned None (None before it was called or where it succeeded)."""
        return self._failure


def open_library(path: Path) -> ctypes.CDLL:
    """The library at `path`, its functions typed by `signatures.SIGNATURES`."""
    return bind(ctypes.CDLL(str(path)))
