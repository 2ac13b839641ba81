"""The compiled kernels build wherever they can: a CPU with AVX-512 and a C++ compiler.

Every kernel test skips when the kernels do not build (a machine without them takes the torch
path), so a source that stopped compiling would only show as skips; this test makes it a failure.
"""

from __future__ import annotations

import os
import shutil

import pytest

from worker_service import native


def test_the_kernels_build_on_a_machine_that_can_build_them() -> None:
    compiler = shutil.which(os.environ.get("CXX") or "g++")
    if compiler is None or " avx512f" not in native.library.cpu_flags():
        pytest.skip("no C++ compiler or no AVX-512 here: the worker takes the torch path")
    assert native.load() is not None, native.failure()


def test_a_cpu_without_avx512_is_refused_without_asking_the_compiler(monkeypatch) -> None:
    from worker_service.native import kernels

    def no_compiler(*args, **kwargs):
        raise AssertionError("the compiler was asked although the CPU has no AVX-512")

    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "_failure", None)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags\t\t: fpu sse2 avx2 fma")
    monkeypatch.setattr(kernels, "build", no_compiler)
    assert kernels.load() is None
    assert "AVX-512" in kernels.failure()
