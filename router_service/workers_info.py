"""What the router learns from its workers when it connects: the model it serves (GetServerInfo)
and the settings that depend on where the workers run."""

from __future__ import annotations

from radixserve.v1 import generation_pb2, router_pb2, worker_pb2


def resolve_overlap(setting: bool | None, infos: list[worker_pb2.GetWorkerInfoResponse]) -> bool:
    """`--overlap` as set, else on when every rank runs on CUDA (a forward pass that leaves the
    CPU to the router), off on CPU (where the router's work would compete with it)."""
    if setting is not None:
        return setting
    return all(info.device.startswith("cuda") for info in infos)


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
