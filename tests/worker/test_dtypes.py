"""`--dtype auto` (the default) resolves to bfloat16 on CUDA or a CPU with native bf16, else float32."""

from __future__ import annotations

import pytest

import worker_service.dtypes as dtypes
from radixserve.launcher_config import config_from_args as launcher_config
from worker.tiny_models import make_tiny_llama
from worker_service.config import parse_config
from worker_service.model_runner import ModelRunner, RunnerConfig

ZEN4_FLAGS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS_FLAGS = "flags\t\t: avx512f amx_bf16 amx_tile amx_int8\n"
SKYLAKE_FLAGS = "flags\t\t: fpu sse2 avx2 avx512f avx512bw\n"


@pytest.mark.parametrize(("native", "device", "expected"), [
    (True, "cpu", "bfloat16"), (False, "cpu", "float32"),
    (False, "cuda", "bfloat16"), (True, "cuda", "bfloat16"),
])
def test_auto_resolves_by_device_and_cpu_probe(native: bool, device: str, expected: str) -> None:
    assert dtypes.resolve_dtype("auto", device, native_bf16_cpu=lambda: native) == expected


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_kept_whatever_the_cpu(name: str) -> None:
    for native in (True, False):
        assert dtypes.resolve_dtype(name, "cpu", native_bf16_cpu=lambda: native) == name


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        dtypes.resolve_dtype("int8", "cpu")


@pytest.mark.parametrize(("cpuinfo", "native"), [
    (ZEN4_FLAGS, True), (SAPPHIRE_RAPIDS_FLAGS, True), (SKYLAKE_FLAGS, False), ("", False),
])
def test_the_probe_reads_avx512_bf16_or_amx_from_cpuinfo(cpuinfo: str, native: bool, tmp_path, monkeypatch) -> None:
    fake = tmp_path / "cpuinfo"
    fake.write_text(cpuinfo)
    monkeypatch.setattr(dtypes, "CPUINFO", fake)
    assert dtypes.cpu_has_native_bf16() is native


def test_missing_cpuinfo_means_float32(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(dtypes, "CPUINFO", tmp_path / "absent")
    assert dtypes.resolve_dtype("auto", "cpu") == "float32"


def test_auto_is_the_default_of_worker_and_launcher() -> None:
    assert parse_config([], env={}).dtype == "auto"
    assert launcher_config(["up"]).dtype == "auto"
    assert parse_config([], env={"RADIXSERVE_DTYPE": "float32"}).dtype == "float32"


@pytest.mark.parametrize(("native", "expected"), [(True, "bfloat16"), (False, "float32")])
def test_the_runner_reports_what_auto_resolved_to(native: bool, expected: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native)
    runner = ModelRunner(RunnerConfig(model_dir=make_tiny_llama(tmp_path), dtype="auto", kv_cache_bytes=1 << 20))
    assert runner.info.dtype == expected
    assert runner.pool.buffer.dtype == dtypes.DTYPES[expected]
