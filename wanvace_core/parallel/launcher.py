"""The ComfyUI side of the parallel workers: start or join them, load the experts there, run prompts.

`RemoteExperts` is what a loaded `WanVACEModel` holds in `remote` when its experts run in workers: the
sampler hands whole runs to it. Workers are separate processes (`python -m wanvace_core.worker`), never
`multiprocessing` children: spawning from inside ComfyUI re-runs ComfyUI's `main.py` in each child.

- `local`: one worker per listed device is started here with `subprocess`, and stopped when the model is
  freed, when ComfyUI exits (a finalizer), or, if ComfyUI dies, by the workers themselves (they watch it).
- `torchrun`: the workers were started on their machines by torchrun; this process connects to rank 0's
  control address (`endpoint`). Freeing the model releases theirs; they stay up for the next load.

A worker that dies, or sends nothing for `timeout_s` (no step finished, no load finished), fails the
prompt with what its log says; local workers are then stopped, and the next prompt starts fresh ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path

import torch

from . import messages
from .messages import WanVACEWorkerError
from .options import ParallelOptions
from .relay import CONTROL_ADDRESS_FILE, DEVICES_ENV, KEY_ENV, PARENT_ENV, RENDEZVOUS_DIR_ENV

logger = logging.getLogger(__name__)

_PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the folder that holds `wanvace_core`
_POLL_S = 0.2
_STOP_GRACE_S = 10.0
_START_S = 180.0


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def cpu_threads_per_worker(world_size: int) -> int:
    """Intra-op threads of each CPU worker: the machine's cores shared out, so the ranks do not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // world_size)


class LocalWorkers:
    """One `python -m wanvace_core.worker` process per listed device, on this machine.

    No port is picked here: a port found free and then closed can be taken by another process before a worker
    binds it. Rank 0 binds both of its ports itself (the store's and the control one, each on port 0) and writes
    them into the workers' private folder, where the other ranks and this process read them.
    """

    def __init__(self, options: ParallelOptions) -> None:
        self.options = options
        self.key = secrets.token_hex(16)
        self.logs = Path(tempfile.mkdtemp(prefix="wanvace-workers-"))
        world = options.world_size
        threads = cpu_threads_per_worker(world) if options.device_type == "cpu" else None
        self.processes: list[subprocess.Popen] = []
        for rank in range(world):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                PYTHONPATH=os.pathsep.join([str(_PACKAGE_PARENT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                **{
                    KEY_ENV: self.key,
                    DEVICES_ENV: ",".join(options.devices),
                    PARENT_ENV: str(os.getpid()),
                    RENDEZVOUS_DIR_ENV: str(self.logs),
                },
            )
            if threads is not None:
                env["OMP_NUM_THREADS"] = str(threads)
            log = open(self.logs / f"rank{rank}.log", "wb")
            command = [
                sys.executable,
                "-m",
                "wanvace_core.worker",
                "--once",
                "--serve",
                "127.0.0.1:0",
            ]
            self.processes.append(
                subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(_PACKAGE_PARENT))
            )
            log.close()
        logger.info("Started %d WanVACE workers (%s); logs in %s", world, ",".join(options.devices), self.logs)

    def control_address(self) -> tuple[str, int] | None:
        """Rank 0's control address once it listens there, else None."""
        try:
            host, _, port = (self.logs / CONTROL_ADDRESS_FILE).read_text().rpartition(":")
        except FileNotFoundError:
            return None
        return host, int(port)

    def problem(self) -> str | None:
        """Why the workers cannot go on (a rank exited), or None while all run."""
        for rank, process in enumerate(self.processes):
            code = process.poll()
            if code is not None:
                return (
                    f"worker rank {rank} exited with code {code}; its log ends:\n{_tail(self.logs / f'rank{rank}.log')}"
                )
        return None

    def log_tails(self) -> str:
        return "\n".join(
            f"--- rank {r} ---\n{_tail(self.logs / f'rank{r}.log', 8)}" for r in range(len(self.processes))
        )

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if all(process.returncode == 0 for process in self.processes):
            shutil.rmtree(self.logs, ignore_errors=True)  # kept after a failure, for its log

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
        for process in self.processes:
            process.wait()


class RemoteExperts:
    """The experts of one loaded model, running in parallel workers. Not thread-safe (ComfyUI runs one prompt)."""

    def __init__(self, options: ParallelOptions, load_request: dict, describe: str) -> None:
        self.options = options
        self.load_request = load_request
        self.describe = describe
        self.workers: LocalWorkers | None = None
        self.conn: Connection | None = None
        self.held_bytes: int | None = None
        self.starts = 0
        self._finalizer: weakref.finalize | None = None

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts (or joins) the workers and loads the experts there; raises what went wrong."""
        self.starts += 1
        try:
            if self.options.launcher == "local":
                self.workers = LocalWorkers(self.options)
                address, key = self.workers.control_address, self.workers.key.encode()
            else:
                host, _, port = self.options.endpoint.rpartition(":")
                address, key = lambda: (host, int(port)), os.environ.get(KEY_ENV, "wanvace-local-workers").encode()
            self.conn = self._connect(address, key)
            hello = self._receive(max(self.options.timeout_s, _START_S), "to greet")
            if hello["world"] != self.options.world_size:
                raise WanVACEWorkerError(
                    f"the workers at {self.options.endpoint} are {hello['world']} ranks, but devices lists "
                    f"{self.options.world_size}; list one device per worker rank (all machines' "
                    "--nproc-per-node together)."
                )
            outcome = self._request(
                "load", self.load_request, "to load the experts", max(self.options.timeout_s, _START_S)
            )
            self.held_bytes = outcome["held_bytes"]
        except BaseException:
            self._abandon()
            raise
        self._finalizer = weakref.finalize(self, _close_quietly, self.conn, self.workers, self.options.launcher)
        logger.info("WanVACE experts of %s loaded in %d workers", self.describe, self.options.world_size)

    def close(self) -> None:
        """Frees the experts in the workers; local workers exit, torchrun ones wait for the next load."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.conn, self.workers = None, None

    @property
    def running(self) -> bool:
        return self.conn is not None

    def _abandon(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self.conn is not None:
            self.conn.close()
        if self.workers is not None:
            self.workers.kill()
        self.conn, self.workers = None, None

    def _connect(self, address_of: Callable[[], tuple[str, int] | None], key: bytes) -> Connection:
        """Connects to rank 0's control address, `address_of()`, None until the workers have chosen it."""
        # Starting Python and importing torch/diffusers takes a while on a busy machine: never less than this.
        wait_s = max(self.options.timeout_s, _START_S)
        deadline = time.monotonic() + wait_s
        while True:
            address = address_of()
            try:
                if address is None:
                    raise ConnectionRefusedError("the workers have not chosen their control port yet")
                return Client(address, authkey=key)
            except AuthenticationError as error:
                raise WanVACEWorkerError(
                    f"the WanVACE workers at {address[0]}:{address[1]} refused this process's key ({error}); set the "
                    "same WANVACE_WORKER_KEY environment variable for ComfyUI and the torchrun workers."
                ) from error
            except (ConnectionRefusedError, FileNotFoundError, OSError) as error:
                self._check_workers()
                if time.monotonic() > deadline:
                    where = "the local workers' control port" if address is None else f"{address[0]}:{address[1]}"
                    raise WanVACEWorkerError(
                        f"no WanVACE worker answered at {where} within {wait_s:g} s "
                        f"({error}); for launcher=torchrun start the workers first (see docs/parallel.md) and give "
                        "rank 0's --serve address as endpoint."
                    ) from error
                time.sleep(_POLL_S)

    def _check_workers(self) -> None:
        problem = None if self.workers is None else self.workers.problem()
        if problem:
            raise WanVACEWorkerError(f"{problem}\nThe next prompt starts fresh workers.")

    def _receive(self, timeout_s: float, doing: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ready = self.conn.poll(_POLL_S)
            except (EOFError, OSError):
                ready = True
            if ready:
                try:
                    return messages.decode(self.conn.recv_bytes())
                except (EOFError, OSError) as error:
                    self._check_workers()
                    raise WanVACEWorkerError(
                        f"the WanVACE workers closed the connection while trying {doing}; the next prompt starts "
                        "fresh workers."
                    ) from error
            self._check_workers()
            if time.monotonic() > deadline:
                tails = "" if self.workers is None else "\n" + self.workers.log_tails()
                raise WanVACEWorkerError(
                    f"the WanVACE workers sent nothing for timeout_s={timeout_s:g} s while trying {doing} (a worker "
                    f"hangs or is far too slow); they were stopped and the next prompt starts fresh ones. Raise "
                    f"timeout_s in WanVACE Parallel Options if a step really takes that long.{tails}"
                )

    def _outcome(self, message: dict, doing: str) -> dict:
        if message["kind"] == "error":
            if message.get("fatal"):
                self._abandon()
            raise WanVACEWorkerError(f"the WanVACE workers failed trying {doing}: {message['error']}")
        return message

    def _request(self, kind: str, fields: dict, doing: str, timeout_s: float) -> dict:
        self.conn.send_bytes(messages.encode(kind, **fields))
        return self._outcome(self._receive(timeout_s, doing), doing)

    # -- sampling --------------------------------------------------------------------------------

    def _sample_fields(self, cond, settings, cache, tokens: int, batched_cfg: bool, windows, rules, loras) -> dict:
        self.options.check_guidance(settings.cfg, settings.cfg_low_noise)
        self.options.check_tokens(tokens)
        if not self.running:
            self.start()  # the previous workers died or hung: fresh ones
        return {
            "cond": messages.tensor_fields(cond),
            "settings": messages.plain(settings),
            "cache": None if cache is None else messages.plain(cache),
            "batched_cfg": batched_cfg,
            "windows": None if windows is None else messages.plain(windows),
            "rules": None if rules is None else messages.plain(rules),
            # Each rank reads the LoRA files itself, as it reads the experts: the same paths on every machine.
            "loras": [{**messages.plain(patch), "path": str(patch.path)} for patch in loras],
        }

    def sample(
        self,
        cond,
        settings,
        callback: Callable[[int, int, torch.Tensor], None] | None,
        cache,
        tokens: int,
        batched_cfg: bool = False,
        windows=None,
        rules=None,
        loras=(),
    ) -> tuple[torch.Tensor, dict | None]:
        """Runs `sample` in the workers: (latents, the cache report's fields or None).

        `cond`, `settings` and `cache` are the sampler's dataclasses (`cache` may be None); `tokens` is the run's
        sequence length (checked against Ulysses); `batched_cfg` batches the CFG passes where the workers do not split
        them (cfg_parallel); `windows` (the sampler's context-window options, or None) run inside the workers, and so do
        `rules` (the guidance options, or None) and `loras` (the model's LoRA patches, which each rank applies).
        """
        fields = self._sample_fields(cond, settings, cache, tokens, batched_cfg, windows, rules, loras)
        try:
            self.conn.send_bytes(messages.encode("sample", **fields))
            stopping: BaseException | None = None
            while True:
                message = self._receive(self.options.timeout_s, "to run a step")
                if message["kind"] != "progress":
                    break
                if callback is not None and stopping is None:
                    try:
                        callback(message["index"], message["total"], message["denoised"])
                    except BaseException as error:  # ComfyUI's cancel: stop the workers within a step
                        stopping = error
                        self.conn.send_bytes(messages.encode("cancel"))
        except WanVACEWorkerError:
            self._abandon()
            raise
        if stopping is not None:
            if message["kind"] == "error":
                self._outcome(message, "to stop")
            raise stopping
        if message["kind"] == "cancelled":
            raise WanVACEWorkerError(f"the WanVACE workers stopped the run: {message['error']}")
        message = self._outcome(message, "to sample")
        return message["latents"], message["report"]

    @contextlib.contextmanager
    def stepped(
        self,
        cond,
        settings,
        cache,
        tokens: int,
        call_sigmas: tuple[float, ...] | None,
        batched_cfg: bool = False,
        windows=None,
        rules=None,
        loras=(),
    ) -> Iterator[SteppedRun]:
        """A run whose solver steps in this process (ComfyUI's SAMPLER): the workers enter `sample` as for
        `sample` and answer each call of the `SteppedRun` this yields with the denoised estimate. `call_sigmas`: the
        sigma of every call the solver will make (step caching counts them), or None for an adaptive solver. Leaving
        the block ends the run; leaving it by an exception (ComfyUI's cancel) stops the workers within the call they
        are in, and the exception goes on."""
        fields = self._sample_fields(cond, settings, cache, tokens, batched_cfg, windows, rules, loras)
        fields["stepped"] = {"call_sigmas": call_sigmas}
        run = SteppedRun(self)
        run.send("sample", **fields)
        try:
            yield run
        except BaseException:
            run.end(stop=True)
            raise
        run.end(stop=False)


class SteppedRun:
    """The workers' side of one solver-stepped run, as a denoiser: `(x, sigma, parts) -> x0`, or with `parts` the
    tuple (x0, conditional x0, unconditional x0 or None, the expert's cfg). `report` (the cache report's fields or
    None) once the run has ended."""

    def __init__(self, remote: RemoteExperts) -> None:
        self.remote = remote
        self.report: dict | None = None
        self.ended = False

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, parts: bool = False):
        if self.ended:
            raise WanVACEWorkerError("the WanVACE workers' run has ended; a solver called the denoiser after its end")
        self.send("call", x=x.cpu(), sigma=sigma.cpu(), parts=parts)
        message = self._receive("to run a denoiser call")
        if message["kind"] != "denoised":  # the run failed (or stopped) in the workers: its outcome came instead
            self.ended = True
            if message["kind"] == "cancelled":
                raise WanVACEWorkerError(f"the WanVACE workers stopped the run: {message['error']}")
            self.remote._outcome(message, "to run a denoiser call")
            raise WanVACEWorkerError(f"the WanVACE workers ended the run early, answering {message['kind']!r}")
        if not parts:
            return message["denoised"].to(x.device)
        uncond = message["uncond_denoised"]
        return (
            message["denoised"].to(x.device),
            message["cond_denoised"].to(x.device),
            None if uncond is None else uncond.to(x.device),
            message["scale"],
        )

    def end(self, stop: bool) -> None:
        """Ends the workers' run (`stop`: as cancelled) and reads its outcome; a no-op once it has ended."""
        if self.ended:
            return
        self.send("end", stop=stop)
        message = self._receive("to end the run")
        self.ended = True
        if stop:
            if message["kind"] == "error":
                self.remote._outcome(message, "to stop")
            return
        message = self.remote._outcome(message, "to sample")
        if message["kind"] == "cancelled":
            raise WanVACEWorkerError(f"the WanVACE workers stopped the run: {message['error']}")
        self.report = message["report"]

    def send(self, kind: str, **fields) -> None:
        try:
            self.remote.conn.send_bytes(messages.encode(kind, **fields))
        except (EOFError, OSError) as error:
            self._lost(
                WanVACEWorkerError(
                    f"the WanVACE workers closed the connection ({error}); the next prompt starts fresh workers."
                )
            )

    def _receive(self, doing: str) -> dict:
        try:
            return self.remote._receive(self.remote.options.timeout_s, doing)
        except WanVACEWorkerError as error:
            self._lost(error)

    def _lost(self, error: WanVACEWorkerError):
        """The workers died, hung or went away: stopped, and the next prompt starts fresh ones."""
        self.ended = True
        self.remote._abandon()
        raise error


def _close_quietly(conn: Connection | None, workers: LocalWorkers | None, launcher: str) -> None:
    try:
        if conn is not None:
            conn.send_bytes(messages.encode("shutdown" if launcher == "local" else "release"))
            if conn.poll(_STOP_GRACE_S):
                conn.recv_bytes()
            conn.close()
    except (EOFError, OSError):
        pass
    if workers is not None:
        workers.stop()


def remote_experts(model, options: ParallelOptions, plan: dict) -> RemoteExperts:
    """The workers' side of `model` (its experts on meta here, `model.worker_source` saying where the workers read
    them), checked against the model; not started yet. `plan` is the runtime plan (`RuntimePlan.to_plain`) the
    workers apply to their experts; `options` its parallel options."""
    options.check_heads(model.reference_expert.config.num_attention_heads)
    options.check_devices(torch.cuda.device_count() if options.device_type == "cuda" else 0)
    request = {
        "plan": plan,
        "source": model.worker_source,
        "torch_dtype": str(model.dtype).removeprefix("torch."),
        "vae_config": dict(model.vae.config),
        "scheduler_config": dict(model.scheduler_config),
        "boundary_ratio": model.boundary_ratio,
    }
    return RemoteExperts(options, request, str(model.source))
