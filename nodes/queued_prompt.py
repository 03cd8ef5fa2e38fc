"""What queue-time validation needs beyond ComfyUI's per-node view, through its server's public hooks.

ComfyUI validates each node of a prompt with that node's own widget values only (a linked input arrives as None, and
the hidden PROMPT is `{}` while validating, in 0.3.75 and 0.33), and an on-prompt handler cannot refuse a prompt
(its exceptions are logged and ignored). Two hooks close the gap:

- `PromptServer.add_on_prompt_handler`: ComfyUI calls it in POST /prompt right before it validates, in the same
  asyncio task; the handler keeps the prompt in a context variable that only that request's validation sees (tasks
  ComfyUI starts for async `validate_inputs` copy it). A node's `validate_inputs` then reads the rest of the graph
  (the model a conditioning node's `model` link comes from, the context windows of the sampler it feeds), so a size
  the model cannot run is refused when the prompt is queued, under the input it is about.
- A middleware on POST /prompt: ComfyUI lists a refusal of `validate_inputs` once under every argument of that
  function (so "width=65 ..." came back 9 times). Of identical refusals of one of our nodes, the middleware keeps
  the one under the input the message starts with (every refusal here names its input first); ComfyUI's own errors
  and other nodes' are left as they are.

Where either hook is missing (a validation that does not come through POST /prompt), validation falls back to what
the node sees itself, and the core checks the same rules again before anything slow runs.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re

from aiohttp import web

logger = logging.getLogger(__name__)

NODE_PREFIX = "WanVACE"
# ComfyUI's core nodes that hold one literal value (its PrimitiveNode is frontend-only: prompts carry its value).
_PRIMITIVES = {"PrimitiveInt", "PrimitiveFloat", "PrimitiveString", "PrimitiveStringMultiline", "PrimitiveBoolean"}
_PROMPT_PATHS = {"/prompt", "/api/prompt"}

_queued: contextvars.ContextVar[dict | None] = contextvars.ContextVar("wanvace_queued_request", default=None)
_installed = False


def install() -> None:
    """Registers the on-prompt handler and the middleware with ComfyUI's server (once; before it starts listening)."""
    global _installed
    if _installed:
        return
    try:
        from server import PromptServer

        server = PromptServer.instance
        server.add_on_prompt_handler(_remember_prompt)
        server.app.middlewares.append(_one_refusal_per_input)
    except (ImportError, AttributeError, RuntimeError) as error:  # no server (a script), or one already listening
        logger.warning(
            "WanVACE: queue-time checks across nodes are off (%s); the core checks when the node runs.", error
        )
    _installed = True


def _remember_prompt(json_data):
    # The request's body, not its prompt: an on-prompt handler of a pack loaded after ours may still put a new prompt
    # into it, and validation must read the one ComfyUI validates.
    _queued.set(json_data if isinstance(json_data, dict) else None)
    return json_data


def queued_prompt() -> dict | None:
    """The prompt ComfyUI is validating in this request, or None (validation outside POST /prompt)."""
    body = _queued.get()
    prompt = None if body is None else body.get("prompt")
    return prompt if isinstance(prompt, dict) else None


# --------------------------------------------------------------------------------------------------------------
# Reading the graph


def current_node_id() -> str | None:
    """The id of the node ComfyUI is validating or running now (ComfyUI sets it around `validate_inputs`)."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return None
    context = get_executing_context()
    return None if context is None else str(context.node_id)


def _is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int))


def linked_node(prompt: dict, node: dict, input_name: str) -> tuple[str, dict] | None:
    """The node whose output `input_name` of `node` is linked to, or None."""
    value = node.get("inputs", {}).get(input_name)
    if not _is_link(value) or str(value[0]) not in prompt:
        return None
    return str(value[0]), prompt[str(value[0])]


def value_of(prompt: dict, node: dict, input_name: str):
    """A widget's value, also through a link to one of ComfyUI's primitive nodes; None where it is not known before
    the prompt runs (linked to any other node)."""
    value = node.get("inputs", {}).get(input_name)
    if isinstance(value, dict) and "__value__" in value:
        return value["__value__"]
    if not _is_link(value):
        return value
    source = linked_node(prompt, node, input_name)
    if source is None or source[1].get("class_type") not in _PRIMITIVES:
        return None
    literal = source[1].get("inputs", {}).get("value")
    return None if _is_link(literal) else literal


def consumers(prompt: dict, node_id: str, class_type: str, input_name: str) -> list[tuple[str, dict]]:
    """The nodes of `class_type` whose `input_name` is linked to an output of node `node_id`."""
    found = []
    for other_id, other in prompt.items():
        if not isinstance(other, dict) or other.get("class_type") != class_type:
            continue
        value = other.get("inputs", {}).get(input_name)
        if _is_link(value) and str(value[0]) == str(node_id):
            found.append((str(other_id), other))
    return found


def model_source(prompt: dict, node: dict, input_name: str = "model") -> tuple[str, dict] | None:
    """The loader node a `model` input comes from, through any LoRA loaders between."""
    seen = set()
    source = linked_node(prompt, node, input_name)
    while source is not None and source[0] not in seen:
        seen.add(source[0])
        if source[1].get("class_type") != "WanVACELoraLoader":
            return source
        source = linked_node(prompt, source[1], "model")
    return None


def this_node(prompt: dict | None = None) -> tuple[dict, str, dict] | None:
    """(the prompt, the id of the node being validated or run, that node) when all are known; `prompt` defaults to the
    one being queued."""
    prompt = queued_prompt() if prompt is None else prompt
    node_id = current_node_id()
    if not isinstance(prompt, dict) or node_id is None or not isinstance(prompt.get(node_id), dict):
        return None
    return prompt, node_id, prompt[node_id]


# --------------------------------------------------------------------------------------------------------------
# One refusal per input


@web.middleware
async def _one_refusal_per_input(request: web.Request, handler):
    try:
        response = await handler(request)
    finally:
        if request.method == "POST" and request.path in _PROMPT_PATHS:
            _queued.set(None)  # a kept-alive connection's next request runs in the same task
    # A refused prompt (400), or one queued with some outputs refused (200 with node_errors).
    if request.method != "POST" or request.path not in _PROMPT_PATHS or not isinstance(response, web.Response):
        return response
    try:
        answer = json.loads(response.text)
    except (AttributeError, TypeError, ValueError):
        return response
    if not isinstance(answer, dict) or not _collapse(answer):
        return response
    return web.json_response(answer, status=response.status)


def _collapse(answer: dict) -> bool:
    """Drops the copies of each refusal of our nodes; True if anything was dropped."""
    dropped = []
    for node in (answer.get("node_errors") or {}).values():
        if not isinstance(node, dict) or not str(node.get("class_type", "")).startswith(NODE_PREFIX):
            continue
        errors = node.get("errors") or []
        by_message: dict[str, list[dict]] = {}
        for error in errors:
            message = _custom_message(error)
            if message is not None:
                by_message.setdefault(message, []).append(error)
        for message, copies in by_message.items():
            if len(copies) < 2:
                continue
            kept = _named_first(message, copies)
            if kept is None:
                continue
            dropped += [error for error in copies if error is not kept]
        node["errors"] = [error for error in errors if not any(error is gone for gone in dropped)]
    if not dropped:
        return False
    details = (answer.get("error") or {}).get("details")
    if isinstance(details, str):
        lines = details.split("\n")
        for error in dropped:
            line = f"{error.get('message')}: {error.get('details')}"
            if line in lines:
                lines.remove(line)
        answer["error"]["details"] = "\n".join(lines)
    return True


def _custom_message(error: dict) -> str | None:
    """Our message in one of ComfyUI's `custom_validation_failed` entries ("<input> - <message>"), or None."""
    if not isinstance(error, dict) or error.get("type") != "custom_validation_failed":
        return None
    name = (error.get("extra_info") or {}).get("input_name")
    details = str(error.get("details", ""))
    prefix = f"{name} - "
    return details[len(prefix) :] if details.startswith(prefix) else None


def _named_first(message: str, copies: list[dict]) -> dict | None:
    """The copy under the input the message starts with ("width=65 ...", "positive prompt is empty ..."), or None."""
    names = sorted({(error.get("extra_info") or {}).get("input_name") or "" for error in copies}, key=len, reverse=True)
    for name in names:
        if name and re.match(rf"{re.escape(name)}\b(?![_-])", message):
            return next(error for error in copies if (error.get("extra_info") or {}).get("input_name") == name)
    return None
