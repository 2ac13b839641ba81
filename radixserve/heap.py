"""The collector and a serving process's startup heap.

A worker holds torch's, transformers' and the model's Python objects (about 300,000 tracked ones
once loaded), a gateway its tokenizer's and the HTTP stack's (about as many). CPython's collector
scans every object it tracks at each full (generation-2) collection: while the worker and the
gateway loaded, `gc.callbacks` saw full collections of 150-300 ms each on this project's 2-core
machine (16 in the worker, 10 in the gateway). One such collection while serving would stop a
stream's tokens for as long.

`freeze_startup_heap()`, called once a service has loaded what it serves, collects once and then
moves every object alive into the collector's permanent generation (`gc.freeze`): full collections
scan only what was allocated since (after it, no collection over 1 ms was seen while 4 streams of
256 tokens were served), and the objects that stay are freed by reference counting as before
(only a reference cycle among them would never be, and the startup heap is kept for the process's
life anyway). Serving without it was not measured to stall: this is a precaution.
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
