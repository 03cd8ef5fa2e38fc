"""Runs a function on N gloo ranks in fresh processes and returns each rank's result (test helper).

Each rank is a spawned process with `torch.distributed` initialised over gloo on 127.0.0.1; `fn(rank,
world, *args)` must be importable (a module-level function). Results travel back through `torch.save`
files, so tensors come back bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wanvace_core.parallel.launcher import cpu_threads_per_worker


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def threads_of_workers(world_size: int):
    """This process computes on as many intra-op threads as each of `world_size` CPU workers does.

    A reference that must equal the workers bitwise needs it: CPU GEMM kernels may split their sums by the
    thread count (seen on an AMX Xeon: 4e-6 between 2 threads and 1 on the same weights).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_threads_per_worker(world_size))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _rank_main(rank: int, world: int, port: int, out: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pt"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 600.0) -> list:
    """`[fn(0, world, *args), ..., fn(world-1, world, *args)]`, each computed on its own gloo rank."""
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            _rank_main, args=(world, free_port(), out, fn, args), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for process in context.processes:
                        process.kill()
                    raise AssertionError(f"the {world} ranks did not finish within {timeout} s")
        except mp.ProcessRaisedException as error:
            details = [
                torch.load(Path(out) / f"rank{r}.pt", weights_only=False)
                for r in range(world)
                if (Path(out) / f"rank{r}.pt").exists()
            ]
            errors = "\n".join(d["error"] for d in details if not d["ok"])
            raise AssertionError(f"a rank failed:\n{errors or error}") from None
        return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False)["result"] for rank in range(world)]
