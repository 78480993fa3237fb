"""OpenMP thread pools, which thread runs the model, and heap memory handed back.

Each thread that starts torch's parallel work (a forward, loading weights) gets its own OpenMP
thread pool. Once a process holds more OpenMP threads than the machine has cores, libgomp (the
OpenMP of pip's torch on Linux) makes idle threads sleep almost at once, so every kernel of a
forward waits for a thread to wake. So the model runs on one thread per process, and a thread
that hands the model over to another frees its own pool first (release_pool): the stage
processes load and decode on their worker thread (stages/worker.py); the async APIs step on one
model thread per Generator. What a second pool costs: benchmarks/HISTORY.md (benchmarks/cores.py).
"""

from __future__ import annotations

import ctypes


def release_pool() -> bool:
    """Free the calling thread's OpenMP pool (OpenMP 5's omp_pause_resource_all; the thread gets a
    new one if it starts parallel work again), so that the model runs at full speed on another
    thread; False where the OpenMP runtime torch loaded has no such call."""
    import torch  # noqa: F401  (loads torch's OpenMP runtime into the process)

    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(1) == 0  # omp_pause_soft


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim): weights just moved, or a
    tokenizer's parsed JSON, were freed into the heap, where they would stay counted in the
    process's memory."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
