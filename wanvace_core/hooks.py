"""How the runtime's steps attach to modules: one way, for every step.

- Hooks are torch module hooks, kept per step in a `ModuleHooks` and removed together, newest first. Not diffusers'
  `HookRegistry`: a registry hook lives in the module's instance `forward`, which cache-dit's WanVACE functor
  replaces for a cached run, so there it silently stops running (tests/test_hooks.py: a counting registry hook on an
  expert or a block ran 4 times uncached and 0 times cached; a module hook 4 and 4). Module hooks run in
  `Module.__call__` around whichever forward is installed, so they survive that, and stay outside the compiled
  block forwards.
- A step that changes the computation itself (interleaved VACE, fp8 matmul, compile, cache-dit's functor) installs
  an instance forward: `install_forward` / `remove_forward`, `runs_forward` to ask which runs, and
  `instance_forward` / `set_instance_forward` to put back one saved before another library replaced it.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle


class ModuleHooks:
    """The module hooks one runtime step registered; `remove` takes them all off, newest first."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def pre(self, module: torch.nn.Module, hook: Callable, *, with_kwargs: bool = False) -> None:
        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=with_kwargs))

    def post(
        self,
        module: torch.nn.Module,
        hook: Callable,
        *,
        with_kwargs: bool = False,
        prepend: bool = False,
        always_call: bool = False,
    ) -> None:
        self._handles.append(
            module.register_forward_hook(hook, with_kwargs=with_kwargs, prepend=prepend, always_call=always_call)
        )

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()


def instance_forward(module: torch.nn.Module) -> Callable | None:
    """The forward installed on this instance (bound), or None where the class's own forward runs."""
    return module.__dict__.get("forward")


def set_instance_forward(module: torch.nn.Module, forward: Callable | None) -> None:
    """Puts back a forward `instance_forward` returned (None: the class's own)."""
    module.__dict__.pop("forward", None)
    if forward is not None:
        module.forward = forward


def install_forward(module: torch.nn.Module, function: Callable) -> None:
    """Has this instance run `function(module, ...)` as its forward."""
    module.forward = types.MethodType(function, module)


def runs_forward(module: torch.nn.Module, function: Callable) -> bool:
    """Whether `function` is the forward `install_forward` installed on this instance."""
    return getattr(instance_forward(module), "__func__", None) is function


def remove_forward(module: torch.nn.Module, function: Callable) -> bool:
    """Takes `function` off this instance if it is the forward installed there; returns whether it was."""
    if not runs_forward(module, function):
        return False
    del module.forward
    return True
