"""A serving process freezes its start-up heap (``services/startup_heap.py``): what is alive then
leaves every later collection, start-up garbage is collected first, and both process entry points
call it once serving starts (run_gateway's ``on_ready`` is exercised by
tests/integration/test_gateway_http.py)."""
from __future__ import annotations

import gc
import inspect

from services.runtime import serve
from services.startup_heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_live_objects_are_frozen_and_startup_garbage_collected(caplog):
    gc.unfreeze()
    try:
        alive = [Node() for _ in range(5)]
        garbage = Node()
        garbage_id = id(garbage)
        del garbage
        caplog.set_level("INFO", logger="services.startup_heap")
        frozen = freeze_startup_heap("test process")
        # Frozen objects can still die by reference count (a daemon thread left by an earlier
        # test drops its last reference), so the count may only have fallen since.
        assert len(alive) < gc.get_freeze_count() <= frozen
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in alive)  # in the permanent generation
        assert garbage_id not in tracked
        assert f"test process: {frozen} start-up objects frozen" in caplog.text
    finally:
        gc.unfreeze()


def test_worker_and_gateway_entry_points_freeze_once_serving():
    """serve_worker freezes after the runtime starts and before health says SERVING; the
    gateway's entry point hands run_gateway the freeze as its on_ready."""
    worker = inspect.getsource(serve.serve_worker)
    assert worker.index("runtime.start(") < worker.index("freeze_startup_heap(") \
        < worker.index("await mark_serving(")
    assert "on_ready=lambda: freeze_startup_heap(\"gateway\")" in inspect.getsource(serve.serve_gateway)
