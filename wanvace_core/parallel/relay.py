"""How the worker ranks find each other and pass rank 0's requests on: the rendezvous and the store relay.

Under torchrun the ranks meet through torch.distributed's `env://` rendezvous; local workers through a store
rank 0 opens on a port it binds itself and writes into their private folder (`RENDEZVOUS_DIR_ENV`), so no
port is ever picked ahead and lost to another process. The store carries the requests from rank 0 to the
others and each rank's status back, so the compute groups (created per loaded model) only carry tensors.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from . import messages

KEY_ENV = "WANVACE_WORKER_KEY"
DEVICES_ENV = "WANVACE_WORKER_DEVICES"
PARENT_ENV = "WANVACE_WORKER_PARENT"
RENDEZVOUS_DIR_ENV = "WANVACE_WORKER_RENDEZVOUS"
STORE_PORT_FILE = "store_port"
CONTROL_ADDRESS_FILE = "control_address"
_RENDEZVOUS_TIMEOUT = timedelta(seconds=600)
# Idle peers wait this long per try (torch logs every timed-out wait); rank 0 leaving ends the wait at once.
_POLL = timedelta(seconds=600)
_CHUNK = 1 << 20


def authkey() -> bytes:
    """The shared secret of the control connection: set the same WANVACE_WORKER_KEY for ComfyUI and torchrun."""
    return os.environ.get(KEY_ENV, "wanvace-local-workers").encode()


class StoreRelay:
    """Requests from rank 0 to every rank, per-step decisions, a stepped run's calls and per-rank statuses, through the
    store."""

    def __init__(self, store: dist.Store, rank: int, world: int) -> None:
        self.store = dist.PrefixStore("wanvace/", store)
        self.rank = rank
        self.world = world
        self.sequence = 0
        self._published_calls: list[str] = []

    def publish(self, data: bytes) -> int:
        if self.sequence:
            self._delete(f"request{self.sequence - 1}")  # every rank has answered it by now
        self._set(f"request{self.sequence}", data)
        self.sequence += 1
        return self.sequence - 1

    def receive(self) -> tuple[int, bytes]:
        key = f"request{self.sequence}"
        self._wait_for(key)
        self.sequence += 1
        return self.sequence - 1, self._get(key)

    def _wait_for(self, key: str) -> None:
        while True:
            try:
                self.store.wait([key], _POLL)
                return
            except dist.DistStoreError:
                continue

    # The store takes large values badly (a 16 MB value reset the connection): values travel in chunks.
    def _set(self, key: str, data: bytes) -> None:
        chunks = [data[start : start + _CHUNK] for start in range(0, len(data), _CHUNK)] or [b""]
        for index, chunk in enumerate(chunks):
            self.store.set(f"{key}/{index}", chunk)
        self.store.set(key, str(len(chunks)).encode())  # last: readers wait for this key

    def _get(self, key: str) -> bytes:
        count = int(self.store.get(key))
        return b"".join(self.store.get(f"{key}/{index}") for index in range(count))

    def _delete(self, key: str) -> None:
        count = int(self.store.get(key))
        for index in range(count):
            self.store.delete_key(f"{key}/{index}")
        self.store.delete_key(key)

    def answer(self, request: int, payload: bytes) -> None:
        self._set(f"status{request}/{self.rank}", payload)

    def answers(self, request: int, timeout: timedelta) -> list[dict]:
        keys = [f"status{request}/{rank}" for rank in range(self.world)]
        self.store.wait(keys, timeout)
        found = [messages.decode(self._get(key)) for key in keys]
        for key in keys:
            self._delete(key)
        return found

    def decide(self, request: int, step: int, stop: bool) -> None:
        self.store.set(f"step{request}/{step}", b"stop" if stop else b"go")

    def decision(self, request: int, step: int) -> bool:
        return self.store.get(f"step{request}/{step}") == b"stop"

    def forget_steps(self, request: int, steps: int) -> None:
        for step in range(steps):
            self.store.delete_key(f"step{request}/{step}")

    # A solver stepping in the ComfyUI process sends each denoiser call through rank 0 to every rank. A call's input
    # (the whole latent) stays in the store until every other rank has read it, no longer: rank 0 frees the calls
    # every rank has read each time it publishes one, and the rest at the end of the request.
    def publish_call(self, request: int, call: int, data: bytes) -> None:
        self._forget_calls(everything=False)
        self._set(f"call{request}/{call}", data)
        self._published_calls.append(f"call{request}/{call}")

    def call(self, request: int, call: int) -> bytes:
        key = f"call{request}/{call}"
        self._wait_for(key)
        data = self._get(key)
        self.store.add(f"{key}/read", 1)
        return data

    def forget_calls(self) -> None:
        self._forget_calls(everything=True)

    def _forget_calls(self, everything: bool) -> None:
        kept = []
        for key in self._published_calls:
            if everything or self.store.add(f"{key}/read", 0) >= self.world - 1:
                self._delete(key)
                self.store.delete_key(f"{key}/read")
            else:
                kept.append(key)
        self._published_calls = kept


def publish_file(path: Path, text: str) -> None:
    """Writes `text` so that a reader sees all of it or no file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def rendezvous() -> tuple[dist.Store, int, int]:
    """(store, rank, world): torchrun's env:// rendezvous, or for local workers rank 0's store on its own port."""
    folder = os.environ.get(RENDEZVOUS_DIR_ENV)
    if not folder:
        return next(dist.rendezvous("env://", timeout=_RENDEZVOUS_TIMEOUT))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port_file = os.environ.get("MASTER_ADDR", "127.0.0.1"), Path(folder) / STORE_PORT_FILE
    if rank == 0:
        store = dist.TCPStore(host, 0, world, True, _RENDEZVOUS_TIMEOUT, wait_for_workers=False)
        publish_file(port_file, str(store.port))
        return store, rank, world
    deadline = time.monotonic() + _RENDEZVOUS_TIMEOUT.total_seconds()
    while not port_file.exists():  # rank 0 is still importing; ComfyUI stops us all if it exits
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not write {port_file} within {_RENDEZVOUS_TIMEOUT}")
        time.sleep(0.05)
    return dist.TCPStore(host, int(port_file.read_text()), world, False, _RENDEZVOUS_TIMEOUT), rank, world
