"""Generate the Python gRPC code for `protos/radixserve/v1/*.proto` into `radixserve/v1/`.

Run as `python -m radixserve.gen_protos`; setup (`make`) does this, and the generated files are
not committed. Regenerating is idempotent.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT


def generate() -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted((PROTO_ROOT / "radixserve" / "v1").glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={OUT_ROOT}",
        f"--pyi_out={OUT_ROOT}",
        f"--grpc_python_out={OUT_ROOT}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    init = OUT_ROOT / "radixserve" / "v1" / "__init__.py"
    init.write_text('"""Generated protobuf and gRPC code (see radixserve/gen_protos.py)."""\n')
    return protos


if __name__ == "__main__":
    done = generate()
    print(f"generated {len(done)} proto files into {OUT_ROOT / 'radixserve' / 'v1'}", file=sys.stderr)
