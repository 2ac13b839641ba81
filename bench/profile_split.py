"""Where a gateway's CPU goes, from a py-spy profile: shares of its busy samples by part.

    py-spy record --native -r 100 -d 12 -p <gateway pid> -f raw -o gateway.txt
    python -m bench.profile_split gateway.txt [--top 25]

py-spy's raw output has one folded stack per line (frames root first, separated by `;`) and
its sample count. Idle samples are left out: the event loop's `epoll_wait` and the waits of
the thread pool and grpc's poller (lock and condition waits). Each busy sample counts under
the innermost of the gateway's own frames on its stack (grouped by `PARTS`), split further by
what runs beneath that frame (grpc, the HTTP layer, the event loop, protobuf, the tokenizer);
a sample with none of our frames counts under grpc, the HTTP layer or the event loop.
"""

from __future__ import annotations

import argparse
import collections

# Path fragments of our frames and the part each belongs to (first match wins).
PARTS = (
    ("gateway_service/router_stream", "router Stream demux and inboxes"),
    ("gateway_service/mailbox", "router Stream demux and inboxes"),
    ("gateway_service/output", "output assembly"),
    ("gateway_service/detokenizer", "output assembly"),
    ("gateway_service/stop_strings", "output assembly"),
    ("gateway_service/tokenizer", "output assembly"),
    ("gateway_service/metrics", "metrics"),
    ("gateway_service/access_log", "metrics"),
    ("gateway_service/openai_api", "HTTP API (ours)"),
    ("gateway_service/many_call", "GenerateMany call"),
    ("gateway_service/service", "generator chain"),
    ("gateway_service/router_choice", "generator chain"),
    ("radixserve/guard", "generator chain"),
    ("gateway_service/", "per request (validation, prompts)"),
    ("radixserve/sampling", "per request (validation, prompts)"),
    ("radixserve/constraints", "per request (validation, prompts)"),
)
# What runs beneath a frame, by a fragment of its frames (first match wins).
BENEATH = (("cygrpc", "grpc core"), (("uvicorn", "h11", "starlette"), "HTTP layer"),
           ("tokenizers", "tokenizer"), ("_message.abi3", "protobuf"), ("asyncio/", "event loop"))
IDLE = ("PyThread_acquire_lock_timed", "pthread_cond_timedwait", "_queue_SimpleQueue_get")
# Our frames under which the whole process runs (the event loop's own callers): not a part.
ROOTS = ("gateway_service/__main__.py", "radixserve/serving.py")


def _part(frame: str) -> str | None:
    if "(" not in frame or any(root in frame for root in ROOTS):
        return None
    return next((part for fragment, part in PARTS if fragment in frame), None)


def _beneath(frames: list[str]) -> str | None:
    for fragments, name in BENEATH:
        fragments = (fragments,) if isinstance(fragments, str) else fragments
        if any(f in frame for frame in frames for f in fragments):
            return name
    return None


def classify(frames: list[str]) -> tuple[str, str]:
    """(part, detail) of one busy sample."""
    ours = [i for i, frame in enumerate(frames) if _part(frame) is not None]
    if not ours:
        beneath = _beneath(frames)
        return (beneath if beneath in ("grpc core", "HTTP layer") else "event loop and other"), frames[-1][:70]
    frame = frames[ours[-1]]
    beneath = _beneath(frames[ours[-1] + 1:])
    if beneath in ("grpc core", "HTTP layer"):
        return f"{beneath} (under our call)", _part(frame)
    part = _part(frame)
    return (part if beneath is None else f"{part} / {beneath}"), frame.split(" (")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("raw", help="py-spy record -f raw output")
    parser.add_argument("--top", type=int, default=25, help="detail lines to print")
    args = parser.parse_args()
    samples = []
    with open(args.raw) as lines:
        for line in lines:
            stack, count = line.rsplit(" ", 1)
            samples.append((stack.split(";"), int(count)))
    busy = [(frames, n) for frames, n in samples
            if not frames[-1].startswith("epoll_wait") and not any(i in f for f in frames for i in IDLE)]
    total = sum(n for _, n in busy)
    print(f"{total} busy samples of {sum(n for _, n in samples)}")
    parts: collections.Counter = collections.Counter()
    details: collections.Counter = collections.Counter()
    for frames, n in busy:
        part, detail = classify(frames)
        parts[part] += n
        details[(part, detail)] += n
    for part, n in parts.most_common():
        print(f"{100 * n / total:5.1f}% {part}")
    print("--- detail")
    for (part, detail), n in details.most_common(args.top):
        print(f"{100 * n / total:5.1f}% {part} | {detail}")


if __name__ == "__main__":
    main()
