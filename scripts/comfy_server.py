"""A real ComfyUI server with this pack installed, in a base folder of its own: started, driven through its HTTP API and
websocket, stopped. The demo (scripts/demo.py) and scripts/make_workflows.py start one; the integration tests drive
it (tests/support/comfyui.py adds what only they need).

The ComfyUI tree is `$WANVACE_COMFY_DIR` (set by scripts/test.sh per dependency set), else
`.cache/comfyui-current`, else `.cache/comfyui-oldest`; the server runs on this interpreter.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import requests
import websocket

REPO_ROOT = Path(__file__).resolve().parents[1]


def _default_comfy_dir() -> Path:
    if os.environ.get("WANVACE_COMFY_DIR"):
        return Path(os.environ["WANVACE_COMFY_DIR"])
    for name in ("comfyui-current", "comfyui-oldest"):
        if (REPO_ROOT / ".cache" / name / "main.py").is_file():
            return REPO_ROOT / ".cache" / name
    return REPO_ROOT / ".cache" / "comfyui-current"


DEFAULT_COMFY_DIR = _default_comfy_dir()

DEFAULT_PYTHON = Path(sys.executable)
BROWSER_DIR = REPO_ROOT / "tests" / "browser"
PACKAGE_DIR_NAME = "ComfyUI-WanVACE"

# Events after which ComfyUI has decided the outcome of a prompt. The history
# entry is only written after these, right before `executing` with node None.
_STATUS_EVENTS = {
    "execution_success": "success",
    "execution_error": "error",
    "execution_interrupted": "interrupted",
}


def free_port() -> int:
    """A port nothing listens on right now. Another process may take it before ComfyUI binds it: `ComfyServer.start`
    then retries on another one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What ComfyUI logs when its port is taken: 0.33 its own line, 0.3.75 asyncio's OSError.
_PORT_IN_USE = re.compile(r"Port \d+ is already in use|address already in use", re.IGNORECASE)


def core_prompt(tag: int = 0) -> dict:
    """A prompt of two core nodes (EmptyImage -> PreviewImage) that runs in milliseconds; prompts of another `tag`
    differ in an input, so none is served from ComfyUI's output cache."""
    return {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": int(tag)}},
        "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
    }


def _file_entries(outputs: dict) -> Iterable[dict]:
    """Yield every {filename, subfolder, type} dict in a history `outputs` map.

    SaveImage uses "images", SaveVideo/SaveWEBM/SaveAnimatedWEBP also use
    "images" (plus "animated": [true]), older video nodes use "gifs"/"videos";
    walking all list values covers every variant without naming them.
    """
    for node_out in outputs.values():
        if not isinstance(node_out, dict):
            continue
        for value in node_out.values():
            if not isinstance(value, list):
                continue
            for item in value:
                if isinstance(item, dict) and "filename" in item:
                    yield item


class _PortTaken(Exception):
    """ComfyUI exited at start because another process listens on its port."""


@dataclass
class RunResult:
    prompt_id: str | None
    # "success", "error", "interrupted", or "rejected" (HTTP 400 from /prompt)
    status: str
    events: list[tuple[str, Any]] = field(default_factory=list)
    # The /history/{prompt_id} entry: {"prompt", "outputs", "status", "meta"}.
    history: dict = field(default_factory=dict)
    # Body of the /prompt answer; holds "error" and "node_errors" when rejected.
    response: dict = field(default_factory=dict)
    base_dir: Path | None = None
    duration_s: float = 0.0
    # Binary websocket frames (previews: a big-endian uint32 event type, then its payload), in arrival order.
    binary_messages: list[bytes] = field(default_factory=list)

    @property
    def outputs(self) -> dict:
        return self.history.get("outputs", {})

    @property
    def error(self) -> dict | None:
        for etype, data in self.events:
            if etype == "execution_error":
                return data
        return None

    @property
    def node_errors(self) -> dict:
        return self.response.get("node_errors", {})

    def events_of(self, etype: str) -> list[Any]:
        return [data for t, data in self.events if t == etype]

    def progress_events(self) -> list[dict]:
        return self.events_of("progress")

    def executed_nodes(self) -> list[str]:
        return [d.get("node") for d in self.events_of("executed")]

    def started_nodes(self) -> list[str]:
        """Nodes ComfyUI started in this prompt (an `executing` event each)."""
        return [d["node"] for d in self.events_of("executing") if d.get("node") is not None]

    def cached_nodes(self) -> list[str]:
        """Nodes ComfyUI served from its output cache instead of running them: the `execution_cached` event's list."""
        return [node for d in self.events_of("execution_cached") for node in d.get("nodes", [])]

    def assert_ran(self, *node_ids: str) -> Self:
        """This result, after checking that each of `node_ids` really ran in its prompt.

        For every test that compares outputs of two prompts: ComfyUI keys cached outputs on a node's inputs (and
        those of the nodes upstream), not on its id, so a node whose inputs equal those of a node of an earlier
        prompt still in the cache is not run: its output is the earlier one, and comparing the two compares a
        result with itself. Raises AssertionError naming the nodes ComfyUI listed in `execution_cached` or never
        started.
        """
        cached = [node for node in node_ids if node in self.cached_nodes()]
        not_run = [node for node in node_ids if node not in cached and node not in self.started_nodes()]
        if self.status == "rejected" or cached or not_run:
            raise AssertionError(
                f"prompt {self.prompt_id} ({self.status}): nodes {cached} were served from ComfyUI's output cache, "
                f"{not_run} did not run; change an input of each (a seed, say) to have it run again"
            )
        return self

    def output_files(self, include_temp: bool = False) -> list[Path]:
        if self.base_dir is None:
            return []
        roots = {"output": self.base_dir / "output"}
        if include_temp:
            roots["temp"] = self.base_dir / "temp"
        files = []
        for item in _file_entries(self.outputs):
            root = roots.get(item.get("type", "output"))
            if root is None:
                continue
            files.append(root / item.get("subfolder", "") / item["filename"])
        return files


class ComfyServer:
    def __init__(
        self,
        base_dir: Path,
        comfy_dir: Path = DEFAULT_COMFY_DIR,
        python: Path | str = DEFAULT_PYTHON,
        port: int | None = None,
        extra_args: Iterable[str] = (),
        env: dict[str, str] | None = None,
        models_from: Path | None = None,
    ):
        """`models_from`: another base directory whose `models/` this server uses (`prepare` links it), for a
        server that needs flags or a process of its own but the same model files."""
        self.base_dir = Path(base_dir).resolve()
        self.comfy_dir = Path(comfy_dir)
        self.python = str(python)
        # A port we picked may be taken before ComfyUI binds it; start() then picks another. A given one is kept.
        self._picks_port = port is None
        self.port = port or free_port()
        self.models_from = None if models_from is None else Path(models_from).resolve()
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.log_path = self.base_dir / "server.log"
        self.start_duration_s: float | None = None
        self.http = requests.Session()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- lifecycle ---------------------------------------------------------

    def prepare(self) -> None:
        models = self.base_dir / "models"
        if self.models_from is not None and not models.is_symlink() and not models.exists():
            models.parent.mkdir(parents=True, exist_ok=True)
            models.symlink_to(self.models_from / "models", target_is_directory=True)
        for sub in ("custom_nodes", "models/diffusers", "input", "output", "user"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        link = self.base_dir / "custom_nodes" / PACKAGE_DIR_NAME
        if not link.is_symlink() and not link.exists():
            link.symlink_to(REPO_ROOT, target_is_directory=True)

    def command(self) -> list[str]:
        return [
            self.python,
            "main.py",
            "--cpu",
            "--listen",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--base-directory",
            str(self.base_dir),
            "--database-url",
            f"sqlite:///{self.base_dir / 'user' / 'comfyui.db'}",
            "--disable-auto-launch",
            "--disable-api-nodes",
            *self.extra_args,
        ]

    def start(self, timeout: float = 180, port_attempts: int = 5) -> None:
        """Starts ComfyUI and waits until it answers. Where the port it was given by `free_port` was taken in the
        meantime (ComfyUI exits saying so), starts it again on another one, up to `port_attempts` times."""
        if not (self.comfy_dir / "main.py").is_file():
            raise RuntimeError(f"ComfyUI not found at {self.comfy_dir}; run `bash scripts/setup.sh` first")
        if self.proc is not None and self.proc.poll() is None:
            return
        self.prepare()
        for attempt in itertools.count(1):
            log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                self._start_once(timeout, log_start)
                return
            except _PortTaken:
                if not self._picks_port or attempt >= port_attempts:
                    raise RuntimeError(f"port {self.port} is in use\n{self._log_since(log_start)[-4000:]}") from None
                self.port = free_port()

    def _start_once(self, timeout: float, log_start: int) -> None:
        env = dict(os.environ)
        env.update(
            PYTHONUNBUFFERED="1",
            # Tests must never reach the network; tiny models live on disk.
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            DO_NOT_TRACK="1",
        )
        env.update(self.extra_env)
        t0 = time.monotonic()
        # The child keeps its own copy of the log descriptor, so ours can close.
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=self.comfy_dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                # Own process group so stop() can also reap anything ComfyUI spawns.
                start_new_session=True,
            )
        deadline = t0 + timeout
        while True:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.proc = None
                if _PORT_IN_USE.search(self._log_since(log_start)):
                    raise _PortTaken(self.port)
                raise RuntimeError(f"ComfyUI exited with {rc} during start\n{self.log_tail()}")
            try:
                answer = self.http.get(f"{self.url}/system_stats", timeout=2)
                # Whoever took the port first answers too: ours is the one serving this base directory.
                if answer.status_code == 200 and self._serves_our_base(answer):
                    break
            except (requests.ConnectionError, requests.Timeout):
                # Not listening yet, or busy loading nodes; keep polling.
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"ComfyUI did not answer within {timeout}s\n{tail}")
            time.sleep(0.25)
        self.start_duration_s = time.monotonic() - t0

    def _serves_our_base(self, answer: requests.Response) -> bool:
        try:
            argv = answer.json()["system"]["argv"]
        except (ValueError, KeyError, TypeError):
            return False
        return str(self.base_dir) in argv

    def stop(self, timeout: float = 20) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=timeout)

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- logs --------------------------------------------------------------

    def log_text(self) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def _log_since(self, offset: int) -> str:
        """The log from byte `offset` on."""
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return log.read().decode("utf-8", errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # --- HTTP API ----------------------------------------------------------

    def get(self, path: str, **kw) -> requests.Response:
        kw.setdefault("timeout", 30)
        return self.http.get(f"{self.url}{path}", **kw)

    def post(self, path: str, payload: Any = None, **kw) -> requests.Response:
        kw.setdefault("timeout", 30)
        return self.http.post(f"{self.url}{path}", json=payload, **kw)

    def system_stats(self) -> dict:
        r = self.get("/system_stats")
        r.raise_for_status()
        return r.json()

    def object_info(self, node_class: str | None = None) -> dict:
        r = self.get(f"/object_info/{node_class}" if node_class else "/object_info", timeout=120)
        r.raise_for_status()
        return r.json()

    def queue_prompt(
        self, prompt: dict, client_id: str | None = None, prompt_id: str | None = None
    ) -> tuple[int, dict]:
        payload: dict[str, Any] = {
            "prompt": prompt,
            "client_id": client_id or uuid.uuid4().hex,
        }
        if prompt_id is not None:
            payload["prompt_id"] = prompt_id
        r = self.post("/prompt", payload, timeout=120)
        try:
            body = r.json()
        except ValueError:
            body = {"raw": r.text}
        return r.status_code, body

    def interrupt(self, prompt_id: str | None = None) -> None:
        self.post("/interrupt", {"prompt_id": prompt_id} if prompt_id else {}).raise_for_status()

    def free(
        self, unload_models: bool = True, free_memory: bool = True, wake: dict | None = None, timeout: float = 120
    ) -> None:
        """POST /free, and return once the prompt worker has acted on it.

        Both ComfyUI versions' prompt worker reads the free flags only after its queue wait returns, and when it
        has run a prompt, only after sending that prompt's `executing` None (where `run_prompt` returns). A /free
        that lands while the worker is between prompts (say in gc) also loses its wake-up: the worker then waits for
        the next prompt, up to 1000 s. So a prompt right after the /free wakes the worker, and a second one, which
        the worker takes from the queue only after it applied the flags, is the sign they were applied: once it
        ran, the unload and the cache reset are done (within `timeout`).

        The core-only prompts replace the cached outputs of the previous prompt. To keep them, as a user's "Unload
        models" between two prompts would, pass the previous prompt as `wake` (it then runs from the cache); that
        only means something without `free_memory`, which empties the cache.
        """
        if wake is not None and free_memory:
            raise ValueError("free_memory empties ComfyUI's output cache: there is nothing for `wake` to keep")
        self.post("/free", {"unload_models": unload_models, "free_memory": free_memory}).raise_for_status()
        for role, prompt in (("wake-up", wake), ("second", wake)):
            result = self.run_prompt(prompt or core_prompt(), timeout=timeout)
            if result.status != "success":
                raise RuntimeError(f"the {role} prompt after /free ended with {result.status}: {result.error}")

    def drop_cached_outputs(self) -> None:
        """Empties ComfyUI's output cache (POST /free with free_memory only, as `free` waits for it); models stay
        loaded. The next prompt runs every node again, whatever the cache type and free memory."""
        self.free(unload_models=False, free_memory=True)

    def history(self, prompt_id: str) -> dict | None:
        """The history entry for prompt_id, or None while ComfyUI has none."""
        r = self.get(f"/history/{prompt_id}")
        r.raise_for_status()
        return r.json().get(prompt_id)

    def queue_state(self) -> dict:
        r = self.get("/queue")
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            q = self.queue_state()
            if not q.get("queue_running") and not q.get("queue_pending"):
                return
            time.sleep(0.2)
        raise TimeoutError(f"queue still busy after {timeout}s: {self.queue_state()}")

    # --- running prompts ---------------------------------------------------

    def run_prompt(
        self,
        prompt: dict,
        timeout: float = 600,
        interrupt_after_progress: int | None = None,
        client_id: str | None = None,
        feature_flags: dict | None = None,
    ) -> RunResult:
        """Queues `prompt` and follows it on the websocket; `feature_flags` are declared as the frontend does
        (e.g. {"supports_preview_metadata": True} for previews with metadata)."""
        client_id = client_id or uuid.uuid4().hex
        t0 = time.monotonic()
        # Connect before queueing so no event for this prompt can be missed.
        ws = websocket.create_connection(f"ws://127.0.0.1:{self.port}/ws?clientId={client_id}", timeout=30)
        binary: list[bytes] = []
        try:
            if feature_flags is not None:
                _declare_feature_flags(ws, feature_flags)
            code, body = self.queue_prompt(prompt, client_id)
            if code != 200:
                return RunResult(
                    prompt_id=None,
                    status="rejected",
                    response=body,
                    base_dir=self.base_dir,
                    duration_s=time.monotonic() - t0,
                )
            prompt_id = body["prompt_id"]
            events, status = self._collect_events(ws, prompt_id, t0 + timeout, interrupt_after_progress, binary)
        finally:
            ws.close()
        history = self._wait_history(prompt_id, timeout=30)
        if status is None:
            status = _status_from_history(history)
        return RunResult(
            prompt_id=prompt_id,
            status=status,
            events=events,
            history=history,
            response=body,
            base_dir=self.base_dir,
            duration_s=time.monotonic() - t0,
            binary_messages=binary,
        )

    def _collect_events(
        self,
        ws,
        prompt_id: str,
        deadline: float,
        interrupt_after_progress: int | None,
        binary: list[bytes] | None = None,
    ) -> tuple[list[tuple[str, Any]], str | None]:
        events: list[tuple[str, Any]] = []
        status = None
        progress_seen = 0
        interrupted_sent = False
        ws.settimeout(1.0)
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"prompt {prompt_id} did not finish in time; last events: "
                    f"{[e[0] for e in events[-10:]]}\n{self.log_tail()}"
                )
            if not self.is_running() and self.proc is not None:
                raise RuntimeError(f"ComfyUI died while running {prompt_id}\n{self.log_tail()}")
            try:
                msg = ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            except websocket.WebSocketConnectionClosedException as e:
                raise RuntimeError(f"websocket closed while running {prompt_id}\n{self.log_tail()}") from e
            # Binary frames carry preview images; ComfyUI sends them only to the client that queued the prompt.
            if not isinstance(msg, str):
                if binary is not None:
                    binary.append(bytes(msg))
                continue
            try:
                message = json.loads(msg)
            except ValueError:
                continue
            etype = message.get("type")
            data = message.get("data")
            if not isinstance(data, dict) or data.get("prompt_id") != prompt_id:
                continue
            events.append((etype, data))
            if etype in _STATUS_EVENTS:
                status = _STATUS_EVENTS[etype]
            elif etype == "progress" and interrupt_after_progress is not None:
                progress_seen += 1
                if progress_seen >= interrupt_after_progress and not interrupted_sent:
                    self.interrupt(prompt_id)
                    interrupted_sent = True
            elif etype == "executing" and data.get("node") is None:
                return events, status

    def _wait_history(self, prompt_id: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            entry = self.history(prompt_id)
            if entry is not None:
                return entry
            if time.monotonic() > deadline:
                return {}
            time.sleep(0.1)


def _declare_feature_flags(ws, flags: dict, timeout: float = 30) -> None:
    """Sends `flags` as the connection's first message and waits for the server's own flags in answer, so the
    server has stored them before a prompt is queued. A server without negotiation never answers."""
    ws.send(json.dumps({"type": "feature_flags", "data": flags}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = ws.recv()
        if isinstance(msg, str) and json.loads(msg).get("type") == "feature_flags":
            return
    raise TimeoutError(f"the server did not answer the feature flags {flags} within {timeout}s")


def _status_from_history(history: dict) -> str:
    st = history.get("status", {})
    if st.get("status_str") == "success":
        return "success"
    for name, _data in st.get("messages", []):
        if name in _STATUS_EVENTS:
            return _STATUS_EVENTS[name]
    return "error"


# --- example media ---------------------------------------------------------


def _examples_module():
    """nodes/examples.py on its own (the `nodes` package imports ComfyUI)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("wanvace_examples", REPO_ROOT / "nodes" / "examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_example_inputs(input_dir: Path) -> dict[str, Path]:
    """Put the shipped example inputs (example_inputs/, see scripts/make_example_inputs.py) into input_dir.

    The same copy the pack makes into ComfyUI's input folder when it loads: files already there are
    kept. Returns name -> path for every example input, copied or not.
    """
    examples = _examples_module()
    input_dir = Path(input_dir)
    examples.copy_missing_examples(input_dir)
    return {p.name: input_dir / p.name for p in sorted(examples.EXAMPLE_DIR.iterdir()) if p.is_file()}


# --- browser check ---------------------------------------------------------


def check_workflows_in_browser(
    server_url: str,
    workflow_paths: Iterable[Path | str],
    out_path: Path | str,
    timeout: float = 600,
) -> list[dict]:
    """Load UI-format workflows into the real frontend via headless Chromium.

    Returns one dict per workflow: file, missing_types, broken_links,
    raw_broken_links, dialogs, load_error, console_errors, console_noise,
    startup_console_errors, api_prompt, node_count, node_types.

    broken_links is checked after the frontend loaded the graph; with the
    default Comfy.Validation.Workflows setting the frontend deletes dangling
    links itself (and shows a "Workflow Validation" toast, captured in
    dialogs), so raw_broken_links checks the file as written.
    """
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node is not installed; run `bash scripts/setup.sh`")
    if not (BROWSER_DIR / "node_modules" / "playwright-core").is_dir():
        raise RuntimeError("playwright-core missing; run `bash scripts/setup.sh`")
    out_path = Path(out_path).resolve()
    cmd = [
        node,
        "check_workflows.mjs",
        "--url",
        server_url,
        "--out",
        str(out_path),
        *[str(Path(p).resolve()) for p in workflow_paths],
    ]
    proc = subprocess.run(
        cmd,
        cwd=BROWSER_DIR,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"browser check failed ({proc.returncode})\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
        )
    report = json.loads(out_path.read_text())
    startup = report.get("startup_console_errors", [])
    results = report["results"]
    for res in results:
        res["startup_console_errors"] = startup
    return results


if __name__ == "__main__":
    # Handy for poking at the harness by hand: serve an empty base dir.
    base = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/wanvace-comfy")
    with ComfyServer(base) as srv:
        print(f"ComfyUI at {srv.url} (started in {srv.start_duration_s:.1f}s); Ctrl-C to stop")
        try:
            while srv.is_running():
                time.sleep(1)
        except KeyboardInterrupt:
            pass
