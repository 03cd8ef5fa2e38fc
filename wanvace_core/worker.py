"""One parallel worker rank: joins the others, loads its part of the experts, runs the requests rank 0 relays.

Started as `python -m wanvace_core.worker`, either by `parallel.launcher.LocalWorkers` (one process per listed
device, on this machine) or by `torchrun` on each machine; the ranks meet as `parallel.relay` describes. Each
rank reads its part of the experts and puts their runtime together (`runtime.loaders.load_on_rank`, through
`runtime.plan.build_model`, the same function ComfyUI's process uses), then samples with `generation.sampling.sample`.

Rank 0 also listens on the control address (`--serve host:port`; port 0 picks a free one, written to the
workers' folder) for the ComfyUI process (`launcher.RemoteExperts`), one connection at a time, and speaks
`messages` to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import WanVACEError
from .generation.conditioning import VACEConditioning
from .generation.guidance import BatchedGuidance, GuidanceOptions, ParallelGuidance
from .generation.sampling import SamplerSettings, sample
from .generation.windows import ContextWindowOptions
from .parallel import messages
from .parallel.groups import ParallelGroups
from .parallel.options import ParallelOptions
from .parallel.relay import (
    CONTROL_ADDRESS_FILE,
    DEVICES_ENV,
    PARENT_ENV,
    RENDEZVOUS_DIR_ENV,
    StoreRelay,
    authkey,
    publish_file,
    rendezvous,
)
from .runtime.caching import CacheOptions
from .runtime.loaders import load_on_rank
from .runtime.lora import LoraPatch
from .runtime.model import WanVACEModel
from .runtime.plan import RuntimePlan

logger = logging.getLogger("wanvace_core.worker")


class Cancelled(WanVACEError):
    """Rank 0 told every rank to stop at this step (the prompt was cancelled in ComfyUI)."""


@dataclasses.dataclass
class LoadedModel:
    model: WanVACEModel
    options: ParallelOptions
    guidance: ParallelGuidance | None
    branch: int
    branch_rank: int


def _device_for(rank: int) -> torch.device:
    listed = os.environ.get(DEVICES_ENV)
    if listed:
        return torch.device(listed.split(",")[rank])
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class Rank:
    def __init__(self, store: dist.Store, rank: int, world: int, device: torch.device) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.device = device
        self.relay = StoreRelay(store, rank, world)
        self.loaded: LoadedModel | None = None
        self.sessions = 0
        self.decided_steps = 0

    # -- loading ---------------------------------------------------------------------------------

    def load(self, request: dict) -> dict:
        self.release()
        try:
            return self._load(request)
        except BaseException:
            if dist.is_initialized():  # a refused load (fp8 kept with sharding, a bad file) leaves no group
                dist.destroy_process_group()
            raise

    def _load(self, request: dict) -> dict:
        plan = RuntimePlan.from_plain(request["plan"])
        options = plan.parallel
        layout = options.layout
        branch, branch_rank = layout.branch_of(self.rank), layout.branch_rank(self.rank)
        self.sessions += 1
        prefix = f"session{self.sessions}/"
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # Each CFG branch is its own world: cache-dit reduces its decision over the default group.
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"{prefix}branch{branch}/", self.store),
            rank=branch_rank,
            world_size=layout.branch_size,
            timeout=timedelta(seconds=options.timeout_s),
        )
        guidance = None
        if options.cfg_parallel:
            peers = dist.ProcessGroupGloo(
                dist.PrefixStore(f"{prefix}peers{branch_rank}/", self.store),
                branch,
                2,
                timedelta(seconds=options.timeout_s),
            )
            guidance = ParallelGuidance(branch, peers)
        model = load_on_rank(request, plan, self.device, ParallelGroups.create(layout, self.device))
        self.loaded = LoadedModel(model, options, guidance, branch, branch_rank)
        held = sum(t.numel() * t.element_size() for e in model.experts for t in _local_tensors(e))
        return {"held_bytes": held}

    def release(self) -> None:
        if self.loaded is None:
            return
        self.loaded.model.close_residency()
        self.loaded = None
        dist.destroy_process_group()

    # -- sampling --------------------------------------------------------------------------------

    def sample(self, request_id: int, request: dict, conn: Connection | None) -> dict:
        if self.loaded is None:
            raise messages.WanVACEWorkerError("no model is loaded in the workers; load it first")
        loaded = self.loaded
        cond = VACEConditioning(**messages.on_device(request["cond"], self.device))
        settings = SamplerSettings(**request["settings"])
        cache = None if request["cache"] is None else CacheOptions.from_plain(request["cache"])
        windows = None if request.get("windows") is None else ContextWindowOptions(**request["windows"])
        rules = None if request.get("rules") is None else GuidanceOptions.from_plain(request["rules"])
        steps = [0]

        def callback(index: int, total: int, denoised: torch.Tensor) -> None:
            steps[0] = index + 1
            if self.rank == 0:
                try:
                    conn.send_bytes(messages.encode("progress", index=index, total=total, denoised=denoised.cpu()))
                    stop = _cancel_requested(conn)
                except (EOFError, OSError):
                    stop = True  # ComfyUI went away: every rank stops at this step, then the session releases
                self.relay.decide(request_id, index, stop)
            else:
                stop = self.relay.decision(request_id, index)
            if stop:
                raise Cancelled(f"cancelled after step {index + 1} of {total}")

        stepped = request.get("stepped")
        stepper = None
        if stepped is not None:
            stepper = _RelayedCalls(self, request_id, conn, loaded.options.timeout_s, stepped["call_sigmas"])
        model = loaded.model.with_loras(*(LoraPatch(**patch) for patch in request["loras"]))
        try:
            # CFG parallel already gives each pass its own devices; batching applies where it does not.
            guidance = loaded.guidance or (BatchedGuidance() if request["batched_cfg"] else None)
            result = sample(
                model,
                cond,
                settings,
                callback=callback,
                cache=cache,
                guidance=guidance,
                windows=windows,
                rules=rules,
                stepper=stepper,
            )
        finally:
            self.decided_steps = steps[0]  # rank 0 deletes the decisions once every rank has answered
        report = None if result.cache_report is None else messages.plain(result.cache_report)
        guided = {"high-noise": settings.cfg > 1.0, "low-noise": settings.cfg_low_noise > 1.0}
        return {
            "latents": result.latents.cpu() if self.rank == 0 else None,
            "report": report,
            "branch": loaded.branch,
            "guided": guided,
        }

    # -- the request loop ------------------------------------------------------------------------

    def handle(self, request_id: int, request: dict, conn: Connection | None) -> dict:
        kind = request["kind"]
        if kind == "load":
            return self.load(request)
        if kind == "sample":
            return self.sample(request_id, request, conn)
        if kind in ("release", "shutdown"):
            self.release()
            return {}
        raise messages.WanVACEWorkerError(f"unknown request {kind!r}")

    def serve_peer(self) -> None:
        """Ranks other than 0: run what rank 0 relays until it says shutdown."""
        while True:
            request_id, data = self.relay.receive()
            request = messages.decode(data)
            answer = self._answer(request_id, request, None)
            self.relay.answer(request_id, answer)
            if request["kind"] == "shutdown":
                return

    def _answer(self, request_id: int, request: dict, conn: Connection | None) -> bytes:
        try:
            return messages.encode("ok", **self.handle(request_id, request, conn))
        except Cancelled as error:
            return messages.encode("cancelled", error=str(error))
        except BaseException as error:  # reported to ComfyUI, then this rank leaves: its groups may be broken
            logger.exception("WanVACE worker rank %d failed on %s", self.rank, request["kind"])
            return messages.encode(
                "error",
                error=f"rank {self.rank}: {type(error).__name__}: {error}",
                trace=traceback.format_exc(),
                fatal=not isinstance(error, WanVACEError),
            )

    def serve_coordinator(self, listener: Listener, keep_serving: bool) -> None:
        """Rank 0: accept the ComfyUI process, relay its requests, answer with every rank's outcome."""
        while True:
            try:
                conn = listener.accept()
            except (AuthenticationError, EOFError, OSError) as error:  # a wrong WANVACE_WORKER_KEY, a port scan
                logger.warning("refused a connection on the control address: %s", error)
                continue
            try:
                finished = self._session(conn)
            finally:
                conn.close()
            if finished or not keep_serving:
                if not finished:
                    self._relay_and_run({"version": messages.PROTOCOL_VERSION, "kind": "shutdown"}, None)
                return

    def _session(self, conn: Connection) -> bool:
        conn.send_bytes(messages.encode("hello", world=self.world, pid=os.getpid()))
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                self._relay_and_run({"version": messages.PROTOCOL_VERSION, "kind": "release"}, None)
                return False
            request = messages.decode(data)
            if request["kind"] == "cancel":
                # It came after the run it was meant to stop had finished its last step (ComfyUI's process was
                # slower to cancel than the run to end): nothing is running, and the next request follows it.
                continue
            outcome = self._relay_and_run(request, conn)
            try:
                conn.send_bytes(outcome)
            except (EOFError, OSError):  # ComfyUI went away while this ran
                self._relay_and_run({"version": messages.PROTOCOL_VERSION, "kind": "release"}, None)
                return False
            if request["kind"] == "shutdown":
                return True
            if messages.decode(outcome).get("fatal"):
                raise SystemExit(1)

    def _relay_and_run(self, request: dict, conn: Connection | None) -> bytes:
        request_id = self.relay.publish(messages.encode(request["kind"], **_fields(request)))
        mine = self._answer(request_id, request, conn)
        self.relay.answer(request_id, mine)
        answers = self.relay.answers(request_id, timedelta(seconds=_answer_timeout(self.loaded)))
        self.relay.forget_steps(request_id, self.decided_steps)
        self.relay.forget_calls()
        self.decided_steps = 0
        return _merge(answers)


class _RelayedCalls:
    """The solver of a run stepped in the ComfyUI process, as this rank's `stepping.Stepper`: each denoiser call it
    makes there reaches rank 0 as a "call" message (the latents, sigma, whether the parts are wanted), which rank 0
    relays to every rank; every rank runs the call on the run's denoiser and rank 0 sends the estimate back. "end"
    ends the run, as cancelled when it says stop."""

    def __init__(self, rank: Rank, request_id: int, conn: Connection | None, timeout_s: float, call_sigmas) -> None:
        self.rank = rank
        self.request_id = request_id
        self.conn = conn
        self.timeout_s = timeout_s
        self._call_sigmas = None if call_sigmas is None else tuple(call_sigmas)

    def call_sigmas(self, sigmas: torch.Tensor) -> tuple[float, ...] | None:
        return self._call_sigmas

    def run(self, denoiser, noise: torch.Tensor, sigmas: torch.Tensor, seed: int, on_step) -> torch.Tensor:
        latents, relay = noise, self.rank.relay
        for call in itertools.count():
            if self.rank.rank == 0:
                message = self._next_from_comfyui()
                relay.publish_call(self.request_id, call, messages.encode(message["kind"], **_fields(message)))
            else:
                message = messages.decode(relay.call(self.request_id, call))
            if message["kind"] == "end":
                if message["stop"]:
                    raise Cancelled(message.get("why", f"cancelled after {call} denoiser calls"))
                return latents
            latents = message["x"].to(self.rank.device)
            try:
                answer = denoiser(latents, message["sigma"], parts=message["parts"])
            except BaseException:
                if self.rank.rank == 0:  # the other ranks wait for a next call: there is none
                    relay.publish_call(self.request_id, call + 1, messages.encode("end", stop=True, why="failed"))
                raise
            if self.rank.rank == 0:
                self._answer(answer, message["parts"])

    def _next_from_comfyui(self) -> dict:
        """The next "call" or "end" from ComfyUI; an "end" with stop when it went away or sent nothing in time."""
        try:
            while self.conn.poll(self.timeout_s):
                message = messages.decode(self.conn.recv_bytes())
                if message["kind"] in ("call", "end"):
                    return message
                # A "cancel" can only be late: this run is stepped by "call" and ended by "end".
        except (EOFError, OSError):
            return {"kind": "end", "stop": True, "why": "ComfyUI closed the connection during a stepped run"}
        return {
            "kind": "end",
            "stop": True,
            "why": f"ComfyUI sent no denoiser call for timeout_s={self.timeout_s:g} s during a stepped run",
        }

    def _answer(self, answer, parts: bool) -> None:
        if parts:
            fields = {
                "denoised": answer.denoised.cpu(),
                "cond_denoised": answer.cond_denoised.cpu(),
                "uncond_denoised": None if answer.uncond_denoised is None else answer.uncond_denoised.cpu(),
                "scale": answer.scale,
            }
        else:
            fields = {"denoised": answer.cpu()}
        try:
            self.conn.send_bytes(messages.encode("denoised", **fields))
        except (EOFError, OSError):
            pass  # ComfyUI went away: the next call it reads is an "end" with stop


def _fields(request: dict) -> dict:
    return {key: value for key, value in request.items() if key not in ("version", "kind")}


def _answer_timeout(loaded: LoadedModel | None) -> float:
    return 3600.0 if loaded is None else loaded.options.timeout_s


def _merge(answers: list[dict]) -> bytes:
    """One outcome for ComfyUI: the first error, else cancelled, else rank 0's result with both branches' reports."""
    for answer in answers:
        if answer["kind"] == "error":
            return messages.encode("error", **_fields(answer))
    if any(answer["kind"] == "cancelled" for answer in answers):
        return messages.encode("cancelled", error=answers[0].get("error", "cancelled"))
    result = _fields(answers[0])
    uncond = [answer for answer in answers if answer.get("branch") == 1]
    if uncond and result.get("report") is not None:
        result["report"] = _with_uncond_branch(result["report"], uncond[0]["report"], result["guided"])
    return messages.encode("ok", **result)


def _with_uncond_branch(cond_report: dict, uncond_report: dict, guided: dict) -> dict:
    """Under cfg_parallel branch 0 made only conditional calls and branch 1 only unconditional ones."""
    experts = []
    for cond_expert, uncond_expert in zip(cond_report["experts"], uncond_report["experts"], strict=True):
        if guided[cond_expert["expert"]]:
            cond_expert = {
                **cond_expert,
                "cfg_steps": uncond_expert["steps"],
                "cfg_cached_steps": tuple(uncond_expert["cached_steps"]),
            }
        experts.append(cond_expert)
    return {**cond_report, "experts": experts}


def _cancel_requested(conn: Connection) -> bool:
    try:
        while conn.poll(0):
            message = messages.decode(conn.recv_bytes())
            if message["kind"] == "cancel":
                return True
    except (EOFError, OSError):
        return True  # ComfyUI went away: stop now, the session loop then releases the model
    return False


def _local_tensors(module: torch.nn.Module):
    for tensor in [*module.parameters(), *module.buffers()]:
        yield tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _watch_parent(parent: int) -> None:
    """A local worker must not outlive ComfyUI, even one killed without cleaning up."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(parent, 0)
            except OSError:
                os._exit(3)

    threading.Thread(target=watch, name="wanvace-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wanvace_core.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--serve", default="127.0.0.1:29511", help="rank 0's control address for ComfyUI (host:port)")
    parser.add_argument("--once", action="store_true", help="exit when ComfyUI disconnects (the local launcher)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[wanvace worker %(process)d] %(levelname)s %(message)s")
    torch.set_grad_enabled(False)
    # FSDP2 renames a sharded expert's class (FSDPWanVACETransformer3DModel, defined in torch), and cache-dit
    # applies its WanVACE patch functor only to classes from diffusers' modules unless told otherwise; the
    # functor itself only needs the diffusers blocks, which FSDP leaves as they are. Read when cache-dit imports.
    os.environ.setdefault("CACHE_DIT_PATCH_FUNCTOR_DISABLE_DIFFUSERS_CHECK", "1")
    if os.environ.get(PARENT_ENV):
        _watch_parent(int(os.environ[PARENT_ENV]))
    store, rank, world = rendezvous()
    worker = Rank(store, rank, world, _device_for(rank))
    if rank != 0:
        worker.serve_peer()
        return 0
    host, _, port = args.serve.rpartition(":")
    with Listener((host, int(port)), authkey=authkey()) as listener:
        serving = "{}:{}".format(*listener.address)
        if os.environ.get(RENDEZVOUS_DIR_ENV):
            publish_file(Path(os.environ[RENDEZVOUS_DIR_ENV]) / CONTROL_ADDRESS_FILE, serving)
        logger.info("rank 0 of %d serving ComfyUI on %s", world, serving)
        print(f"WANVACE_WORKER_READY {serving}", flush=True)
        worker.serve_coordinator(listener, keep_serving=not args.once)
    return 0


if __name__ == "__main__":
    sys.exit(main())
