"""Work split across processes forked from this one, where forking is safe.

A forked process shares the imports already made (transformers' modeling modules take
seconds each), so a sweep over many model types takes a fraction of the time. Forking is
safe only from a process running one thread, on Linux, that has not initialised CUDA (a
forked process cannot use it).

Example::

    jobs = fork_jobs(None, len(model_types))
    if jobs:
        with forked_pool(jobs) as pool:
            futures = {pool.submit(work, t): t for t in model_types}
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

import torch

__all__ = ["fork_jobs", "forked_pool"]

#: pieces of work per process below which forking costs more than it saves
_AT_LEAST = 8


def fork_jobs(jobs: int | None, items: int) -> int:
    """How many processes to fork for ``items`` pieces of work: at most ``jobs`` (default:
    one per CPU this process may use); 0 where forking is unsafe here, or would cost more
    than it saves."""
    if jobs is None:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    jobs = min(jobs, items // _AT_LEAST)
    safe = (
        sys.platform.startswith("linux")
        and threading.active_count() == 1
        and not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    )
    return jobs if jobs >= 2 and safe else 0


def _one_thread() -> None:
    # the processes share the CPUs: one torch thread each (and no OpenMP pool forked)
    torch.set_num_threads(1)


@contextmanager
def forked_pool(jobs: int) -> Iterator[ProcessPoolExecutor]:
    """``jobs`` processes forked from this one, each running one torch thread; on leaving
    (an error or an interrupt too), the work not started is dropped and the rest awaited.
    With fork, every process starts at the first submit, before the pool's own threads."""
    context = multiprocessing.get_context("fork")
    pool = ProcessPoolExecutor(jobs, mp_context=context, initializer=_one_thread)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
