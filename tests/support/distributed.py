"""Gloo ranks and parallel workers on this machine (test helpers).

- `RankPool(world)`: `world` processes with `torch.distributed` initialised over gloo on 127.0.0.1, which
  run one module-level function after another: `pool.run(fn, *args)` is `[fn(0, world, *args), ...,
  fn(world-1, world, *args)]`. Arguments and results travel as `torch.save` bytes, so tensors come back bit for
  bit. The process group is initialised once per pool. Ranks are forked from multiprocessing's fork server,
  which imported torch, diffusers and the pack once (`_PRELOAD`) and has run no tensor work (GNU OpenMP's pool
  does not survive a fork): a fresh rank then costs a fork, not the 8-10 s of imports a spawned one pays on a
  busy two-core machine.
- `run_ranks(world, fn, *args)`: the same on ranks started for this one call, for a check that needs fresh
  processes (one that measures a process's memory: its baseline is taken in the rank, after the fork).
- `ServingWorkers(world)`: `python -m wanvace_core.worker` ranks that stay up between loads, as torchrun's do.

Every rendezvous here goes through a TCPStore this process hosts on a port the kernel picked when it bound it:
a port chosen free and handed over later can be taken in between (EADDRINUSE was seen under load).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wanvace_core.parallel.launcher import cpu_threads_per_worker

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]
# How long the ranks may take to join the store (spawning and importing torch on a busy two-core machine).
_JOIN_TIMEOUT = timedelta(seconds=600)
# After one rank failed, how long the others get to report their own error (often the cause) before the kill.
_FAILURE_GRACE_S = 5.0
# What the fork server imports before it forks the first rank: what every rank function needs.
_PRELOAD = [
    "tests.support.distributed",
    "bench.rss",
    "wanvace_core.worker",
    "wanvace_core.parallel.sharding",
    "wanvace_core.parallel.sequence",
    "diffusers.models.transformers.transformer_wan_vace",
    "torch.distributed.tensor",
]


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


def hosted_store() -> dist.TCPStore:
    """A TCPStore served by this process on a port the kernel assigned; ranks join it as clients."""
    return dist.TCPStore(HOST, 0, None, True, _JOIN_TIMEOUT, wait_for_workers=False)


def _dumps(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _serve_rank(rank: int, world: int, port: int, conn: Connection) -> None:
    """One rank of a `RankPool`: runs each task it receives, until the pool closes its end of the pipe."""
    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, world, False, _JOIN_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        while True:
            try:
                task = conn.recv_bytes()
            except EOFError:  # the pool was closed, or the pytest process died
                break
            try:
                fn, args = _loads(task)
                answer = _dumps({"ok": True, "result": fn(rank, world, *args)})
            except BaseException:
                # This rank leaves: its peers may be waiting in a collective, and the pool replaces them all.
                conn.send_bytes(_dumps({"ok": False, "error": traceback.format_exc()}))
                raise
            conn.send_bytes(answer)
            del answer
            gc.collect()  # the previous task's models go before the next task allocates
    finally:
        dist.destroy_process_group()
    # Everything was answered: skip the interpreter's teardown of torch and the models (5-10 s on a busy machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankPool:
    """`world` gloo ranks (one CPU thread each), spawned on the first `run` and reused by the next ones.

    Whatever a function leaves in its process (imports, caches, module state) is there for the next one; the
    functions run here build their models and meshes themselves. A failure or a timeout kills every rank (a
    rank may be stuck in a collective) and the next `run` spawns fresh ones.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self._store: dist.TCPStore | None = None
        self._ranks: list[tuple[mp.Process, Connection]] = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def _start(self) -> None:
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)  # read when the server starts, with the first pool
        self._store = hosted_store()
        for rank in range(self.world):
            ours, theirs = context.Pipe()
            # Daemonic: should a pool be left open, the interpreter's exit stops its ranks instead of waiting on them.
            process = context.Process(
                target=_serve_rank, args=(rank, self.world, self._store.port, theirs), daemon=True
            )
            process.start()
            theirs.close()
            self._ranks.append((process, ours))

    def run(self, fn: Callable, *args, timeout: float = 600.0) -> list:
        """`[fn(0, world, *args), ..., fn(world-1, world, *args)]`, each computed on its own rank."""
        if not self._ranks or any(not process.is_alive() for process, _ in self._ranks):
            self.close()
            self._start()
        task = _dumps((fn, args))
        try:
            for _, conn in self._ranks:
                conn.send_bytes(task)
            return self._collect(timeout)
        except BaseException:
            self.close()
            raise

    def _collect(self, timeout: float) -> list:
        answers: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        failed_at = None
        while len(answers) < self.world:
            pending = {conn: rank for rank, (_, conn) in enumerate(self._ranks) if rank not in answers}
            until = deadline if failed_at is None else min(deadline, failed_at + _FAILURE_GRACE_S)
            ready = wait(list(pending), timeout=max(0.0, until - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = pending[conn]
                try:
                    answers[rank] = _loads(conn.recv_bytes())
                except EOFError:
                    process = self._ranks[rank][0]
                    process.join(timeout=5)
                    answers[rank] = {"ok": False, "error": f"rank {rank} exited with code {process.exitcode}"}
                if not answers[rank]["ok"] and failed_at is None:
                    failed_at = time.monotonic()
        errors = [f"rank {rank}:\n{answer['error']}" for rank, answer in sorted(answers.items()) if not answer["ok"]]
        if errors:
            raise AssertionError("a rank failed:\n" + "\n".join(errors))
        if len(answers) < self.world:
            raise AssertionError(f"the {self.world} ranks did not finish within {timeout} s")
        return [answers[rank]["result"] for rank in range(self.world)]

    def close(self) -> None:
        """Stops the ranks: each leaves its loop when its pipe closes; one that does not (busy, stuck) is killed."""
        for _, conn in self._ranks:
            conn.close()
        deadline = time.monotonic() + 10.0
        for process, _ in self._ranks:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        self._ranks = []
        self._store = None


class RankPools:
    """One `RankPool` per world size, spawned when first asked for; `close` stops them all."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world: int) -> RankPool:
        if world not in self._pools:
            self._pools[world] = RankPool(world)
        return self._pools[world]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def run_ranks(world: int, fn: Callable, *args, timeout: float = 600.0) -> list:
    """`[fn(0, world, *args), ..., fn(world-1, world, *args)]`, each computed on its own gloo rank, in processes
    spawned for this call alone."""
    with RankPool(world) as pool:
        return pool.run(fn, *args, timeout=timeout)


# --------------------------------------------------------------------------------------------------
# The product's workers, kept up between loads


class ServingWorkers:
    """`world` `python -m wanvace_core.worker --serve` ranks on this machine, one CPU device each, that serve one
    load after another (a model's `remote.close()` releases it; they wait for the next), as torchrun's workers
    do. Load into them with `options(...)` (launcher=torchrun, their endpoint).

    They run with what the local launcher gives its workers (`launcher.LocalWorkers`: the devices, this process
    as the parent they watch, `cpu_threads_per_worker` intra-op threads) except `--once`; their env://
    rendezvous joins a store hosted here (`TORCHELASTIC_USE_AGENT_STORE`, as under torchrun's agent).
    """

    def __init__(self, world: int, logs: Path) -> None:
        self.world = world
        self.logs = logs
        self.starts = 0
        self.endpoint = ""
        self.processes: list[subprocess.Popen] = []
        self._store: dist.TCPStore | None = None

    def options(self, **fields):
        from wanvace_core.parallel import ParallelOptions

        return ParallelOptions(
            **{"devices": ("cpu",) * self.world, "launcher": "torchrun", "endpoint": self.endpoint, **fields}
        )

    @property
    def running(self) -> bool:
        return bool(self.processes) and all(process.poll() is None for process in self.processes)

    def ensure_running(self) -> ServingWorkers:
        """Starts them when none run (first use, or after a failure stopped them)."""
        if not self.running:
            self.stop()
            self._start()
        return self

    @contextlib.contextmanager
    def stopped_on_failure(self):
        """Stops them when the block raises: a failed load or run may leave a rank mid-request, so the next user
        gets fresh ones (`ensure_running`)."""
        try:
            yield self
        except BaseException:
            print(f"the serving workers' logs end:\n{self.tails()}")  # shown with the failure
            self.stop()
            raise

    def log(self, rank: int) -> str:
        return self._log_path(rank).read_text(errors="replace")

    def tails(self) -> str:
        return "\n".join(f"--- rank {r} ---\n" + "\n".join(self.log(r).splitlines()[-30:]) for r in range(self.world))

    def _log_path(self, rank: int) -> Path:
        return self.logs / f"start{self.starts}-rank{rank}.log"

    def _start(self, attempts: int = 3) -> None:
        from wanvace_core.worker import DEVICES_ENV, PARENT_ENV

        for attempt in range(attempts):
            self.starts += 1
            self._store = hosted_store()
            # The control port is bound by rank 0 once it has imported torch: a port another process takes in the
            # meantime makes rank 0 exit, and the whole set is started again on another one.
            self.endpoint = f"{HOST}:{_free_port()}"
            env = dict(os.environ)
            env.update(
                WORLD_SIZE=str(self.world),
                LOCAL_WORLD_SIZE=str(self.world),
                MASTER_ADDR=HOST,
                MASTER_PORT=str(self._store.port),
                TORCHELASTIC_USE_AGENT_STORE="True",
                OMP_NUM_THREADS=str(cpu_threads_per_worker(self.world)),
                PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                **{DEVICES_ENV: ",".join(("cpu",) * self.world), PARENT_ENV: str(os.getpid())},
            )
            command = [sys.executable, "-m", "wanvace_core.worker", "--serve", self.endpoint]
            self.logs.mkdir(parents=True, exist_ok=True)
            for rank in range(self.world):
                with open(self._log_path(rank), "wb") as log:
                    self.processes.append(
                        subprocess.Popen(
                            command,
                            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            cwd=str(REPO),
                        )
                    )
            deadline = time.monotonic() + 300
            while "WANVACE_WORKER_READY" not in self.log(0):
                if self.processes[0].poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            else:
                return
            address_taken = "Address already in use" in self.log(0)
            tails = self.tails()
            self.stop()
            if not address_taken or attempt == attempts - 1:
                raise AssertionError(f"the {self.world} serving workers did not start:\n{tails}")

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []
        self._store = None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]
