"""Starting ranks for the multi-process tests: a free port, and processes with a deadline.

Example::

    from ranks import free_port, run_ranks

    run_ranks(train_one_rank, (free_port(), str(tmp_path)), nprocs=2, timeout_s=120)
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    fn: Callable[..., Any], args: tuple[Any, ...], *, nprocs: int, timeout_s: float
) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; fail the test past ``timeout_s``.

    A rank that raises fails the test with its traceback (``ProcessRaisedException``).
    """
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {nprocs} ranks did not finish in {timeout_s} s")
