"""A serving process's start-up heap, kept out of later garbage collections.

A worker holding a loaded engine tracks ~220,000 objects (modules, the model's modules and
tensors, tokenizer tables), a gateway ~94,000; almost all of them live as long as the process.
CPython's full (generation-2) collection walks every tracked object, holding the GIL: in a
served 16-client load on the built-in model one such collection stopped the worker for 114 ms,
a stall of every stream's next token (AMD EPYC VM, `tandem up` loaded by `tandem bench serve
--max-concurrency 16 --dataset random`, collections timed through ``gc.callbacks``). Once
serving starts, ``gc.freeze()`` moves the start-up heap into the permanent generation, which
collections skip; garbage from start-up is collected first. vLLM's engine does the same after
its warm-up (``vllm.utils.gc_utils.freeze_gc_heap``).
"""
from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect, then freeze every object alive now (``gc.freeze``); log and return how many
    objects are frozen. ``what`` names the process in the log line. Call once, when start-up
    (loading, warm-up) is done and serving begins."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of garbage collection", what, frozen)
    return frozen
