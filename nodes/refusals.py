"""How the nodes' `validate_inputs` refuse a prompt when it is queued.

ComfyUI shows the string `validate_inputs` returns (True accepts), and what it does with that function's arguments
decides which inputs each node takes there:

- It lists a refusal under every argument (queued_prompt keeps the copy under the input the message starts with, so
  every refusal names its input first: "width=65 ...").
- It skips its own range and list checks for the arguments. So a node takes only the inputs with a rule ComfyUI
  cannot check (4n+1 frames, multiples of 16, a pair of inputs, files that must fit together) and checks their
  ranges again itself, and the combos, whose list ComfyUI 0.3.75 does not check on V3 nodes.
- Every other input keeps ComfyUI's range check under that input alone, which refuses NaN too (`nan_refusing_min`)
  and +-inf.
- A linked input arrives as None (its value does not exist before the prompt runs), and an unconnected optional one
  is left out (`NOT_CONNECTED` tells the two apart).
"""

from __future__ import annotations

from ..wanvace_core import WanVACEError, WanVACEInputError

# The default of a `validate_inputs` argument that ComfyUI leaves out when its optional input is not connected.
NOT_CONNECTED = object()


class Refusal:
    """Keeps the message of the `WanVACEError` that the checks inside `with Refusal() as refusal:` raise; a node's
    `validate_inputs` then returns `refusal.message or True`.

    A context, not a decorator: ComfyUI reads which inputs to pass from `validate_inputs`' own arguments
    (`inspect.getfullargspec`, which does not look through a wrapper's `__wrapped__`)."""

    message: str | None = None

    def __enter__(self) -> Refusal:
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, WanVACEError):
            self.message = str(error)
            return True
        return False


def check_choice(name: str, value: object, choices) -> None:
    """Refuses a combo's value outside its list (ComfyUI 0.3.75 does not check a V3 node's combo)."""
    if value not in choices:
        raise WanVACEInputError(f"{name}={value!r} is unknown; choose one of {', '.join(choices)}.")
