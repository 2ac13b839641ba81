"""`radixserve.heap.freeze_startup_heap`: what is alive when it runs leaves the collector's scans
(a full collection no longer visits it), garbage alive then is collected first rather than kept
for good, and what is allocated afterwards is still scanned and its cycles collected. Run in a
child interpreter, so this test process's own collector is left as it is."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import gc, weakref
    from radixserve.heap import freeze_startup_heap

    class Node:
        pass

    kept = [Node() for _ in range(1000)]          # the startup heap
    cycle = Node(); cycle.me = cycle                # garbage alive at startup: a reference cycle
    garbage = weakref.ref(cycle); del cycle
    freeze_startup_heap("test")
    assert garbage() is None, "a startup cycle was frozen instead of collected"
    assert gc.get_freeze_count() >= len(kept)
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(o) in tracked for o in kept), "startup objects are still scanned"
    later = Node(); later.me = later                # allocated while serving
    assert id(later) in {id(o) for o in gc.get_objects()}
    ref = weakref.ref(later); del later
    gc.collect()
    assert ref() is None, "a cycle allocated after the freeze was not collected"
    print("ok")
""")


def test_the_startup_heap_leaves_the_collectors_scans_and_later_cycles_are_still_collected() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
