"""The collector and a serving process's startup heap.

A worker holds torch's, transformers' and the model's Python objects (about a million), a gateway
its tokenizer's and the HTTP stack's. CPython's collector scans every object it tracks at each
full (generation-2) collection, and serving makes those often: each token allocates a few
protobufs, futures and lists, enough survive a young collection to trigger a full one every
second or two, and on this project's 2-core machine each took 150-300 ms in the worker and the
gateway (measured with `gc.callbacks`: 16 in the worker, 10 in the gateway, over 6 streams of
256 tokens). A single stream's tokens stopped for that long, several times a second in all.

`freeze_startup_heap()`, called once a service has loaded what it serves, collects once and then
moves every object alive into the collector's permanent generation (`gc.freeze`): full collections
scan only what was allocated since, and the objects that stay are freed by reference counting as
before (only a reference cycle among them would never be, and the startup heap is kept for the
process's life anyway).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap(service: str) -> None:
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("%s: %d startup objects moved out of the collector's scans (%.0f ms)", service,
             gc.get_freeze_count(), (time.perf_counter() - start) * 1e3)
