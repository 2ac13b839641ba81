"""`python -m gateway_service` as a real process: health, reflection, and the README's grpcurl
call, in front of a fake router."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.background import BackgroundLoop
from gateway.fake_router import FakeRouter
from gateway.harness import server_info
from procs import ServiceProcesses, free_port

GRPCURL = str(Path(sys.executable).parent / "grpcurl")


@pytest.fixture(scope="module")
def gateway_process(smollm2_dir, tokenizer):
    loop = BackgroundLoop()
    router = FakeRouter(server_info())
    loop.run(router.start())
    router.script(tokenizer.encode_prompt(" there, how are you?") + [2])
    port = free_port()
    try:
        with ServiceProcesses() as procs:
            procs.start("gateway", [
                sys.executable, "-m", "gateway_service", "--port", str(port),
                "--model", str(smollm2_dir), "--routers", router.address,
            ])
            procs.wait_healthy(f"127.0.0.1:{port}", timeout_s=60)
            yield f"127.0.0.1:{port}", router
    finally:
        loop.run(router.stop())
        loop.close()


def grpcurl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GRPCURL, *args], capture_output=True, text=True, timeout=30)


@pytest.mark.timeout(120)
def test_reflection_lists_the_service(gateway_process):
    address, _ = gateway_process
    listed = grpcurl("-plaintext", address, "list")
    assert listed.returncode == 0, listed.stderr
    assert "radixserve.v1.GenerationService" in listed.stdout.split()
    described = grpcurl("-plaintext", address, "describe", "radixserve.v1.GenerationService")
    assert "rpc Generate" in described.stdout


@pytest.mark.timeout(120)
def test_readme_generate_call_streams_json_chunks(gateway_process):
    address, router = gateway_process
    done = grpcurl("-plaintext", "-d", '{"prompt": "Hello", "max_tokens": 16}', address,
                   "radixserve.v1.GenerationService/Generate")
    assert done.returncode == 0, done.stderr
    decoder = json.JSONDecoder()
    chunks, text = [], done.stdout.strip()
    while text:
        chunk, end = decoder.raw_decode(text)
        chunks.append(chunk)
        text = text[end:].lstrip()
    assert len(chunks) > 1, chunks
    assert "".join(c.get("text", "") for c in chunks) == " there, how are you?"
    # grpcurl prints the proto field names.
    assert chunks[-1]["finish_reason"] == "FINISH_REASON_STOP"
    assert chunks[-1]["usage"]["completion_tokens"] == sum(len(c.get("token_ids", [])) for c in chunks)
    assert router.state.requests[-1].max_tokens == 16


@pytest.mark.timeout(120)
def test_generate_many_from_grpcurl(gateway_process):
    """Two requests on one GenerateMany call, as grpcurl sends a client stream (several JSON
    messages after -d); each id's updates join to the text its Generate call streams."""
    address, _ = gateway_process
    done = grpcurl("-plaintext", "-d",
                   '{"id": 1, "generate": {"prompt": "Hello", "max_tokens": 16}} '
                   '{"id": 2, "generate": {"prompt": "Hi", "max_tokens": 3}}',
                   address, "radixserve.v1.GenerationService/GenerateMany")
    assert done.returncode == 0, done.stderr
    decoder = json.JSONDecoder()
    texts: dict[str, str] = {}
    finishes: dict[str, str] = {}
    text = done.stdout.strip()
    while text:
        message, end = decoder.raw_decode(text)
        text = text[end:].lstrip()
        for update in message["updates"]:
            # grpcurl prints 64-bit integers as strings.
            texts[update["id"]] = texts.get(update["id"], "") + update["response"].get("text", "")
            finishes[update["id"]] = update["response"].get("finish_reason", "")
    assert texts == {"1": " there, how are you?", "2": " there, how"}
    assert finishes == {"1": "FINISH_REASON_STOP", "2": "FINISH_REASON_LENGTH"}
