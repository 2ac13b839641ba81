"""What the router learns from its workers when it connects: the model it serves (GetServerInfo)
and the settings that depend on where the workers run."""

from __future__ import annotations

from radixserve.v1 import generation_pb2, router_pb2, worker_pb2


def resolve_overlap(setting: bool | None, infos: list[worker_pb2.GetWorkerInfoResponse]) -> bool:
    """`--overlap` as set, else off when a rank runs on the CPU (where the router's work would
    compete with its forward pass; a rank that names no device counts as one), on otherwise: a
    CUDA forward pass, or the stack bench's fake worker (`bench/fake_worker_group.py`, device
    "fake"), leaves the CPU to the router."""
    if setting is not None:
        return setting
    return not any(info.device in ("", "cpu") or info.device.startswith("cpu:") for info in infos)


def summarize(
    infos: list[worker_pb2.GetWorkerInfoResponse], max_pages: int, served_model_name: str,
) -> router_pb2.GetServerInfoResponse:
    first = infos[0]
    num_pages = min(info.num_pages for info in infos)
    if max_pages:
        num_pages = min(num_pages, max_pages)
    model = generation_pb2.GetModelInfoResponse(
        model_name=served_model_name or first.model_name,
        dtype=first.dtype,
        quantization=first.quantization,
        context_len=min(info.context_len for info in infos),
        page_size=first.page_size,
        num_pages=num_pages,
        tp_size=len(infos),
    )
    return router_pb2.GetServerInfoResponse(
        model=model, vocab_size=first.vocab_size, eos_token_ids=first.eos_token_ids
    )
