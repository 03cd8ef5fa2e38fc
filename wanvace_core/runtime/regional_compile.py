"""Regional torch.compile: each transformer and VACE block runs its class's forward compiled by `torch.compile`
(one compiled function per block class, shared by every block of both experts), while the expert around it stays
eager.

Only the block's forward is compiled, not its `__call__` (which `ModelMixin.compile_repeated_blocks` compiles; its
block list is empty in diffusers 0.36 anyway): the module hooks around each block (the residency's block
streaming, Ulysses' splits, FSDP2's all-gathers) then run eagerly as before, and what runs inside the block (LoRA
hooks on its layers, fp8 matmul, the attention backend) is traced into the block's graph, guarded on those hooks so
a LoRA added or removed between runs is never left out of a graph traced before. The blocks share their
code and their shapes, so dynamo traces a few graphs once and every block of both experts reuses them; a new
resolution retraces once, with the changed sizes marked dynamic from then on.

cache-dit's WanVACE patch functor gives every main block its own forward that reads the block's index (`_i`) to add
a VACE hint; compiled, that would trace one graph per block. `compiled_cached_blocks` therefore has those blocks
run the compiled class forward and add the hint outside it, as the functor does, for one cached run.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from pathlib import Path

import torch
from diffusers.models import attention_dispatch

from ..errors import WanVACEInputError
from ..hooks import install_forward, instance_forward, remove_forward, runs_forward, set_instance_forward
from ..load.loaded import block_lists_of


@functools.cache
def compiled_forward(block_class: type[torch.nn.Module]):
    """The one compiled forward of `block_class`, called with the block as its first argument."""
    # diffusers 0.36's attention dispatch asks `is_torch_version` on every call, which torch 2.8's dynamo cannot
    # trace (packaging's parser, behind functools.cache); its answer is fixed for the process, so dynamo is told
    # to take it as a constant.
    torch.compiler.assume_constant_result(inspect.unwrap(attention_dispatch.is_torch_version))
    compiled = torch.compile(block_class.forward)

    @functools.wraps(block_class.forward)
    def forward(self, *args, **kwargs):
        # dynamo's default trusts that module hooks never change; LoRA adds and removes hooks inside blocks per run,
        # and a graph traced without them would silently run on without the LoRA (measured: 0.13 off). The patch
        # costs ~23 us a call (CPU, measured): 0.13 s over a 40-step A14B generation's 3,840 block calls.
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
            return compiled(self, *args, **kwargs)

    return forward


def _blocks(expert: torch.nn.Module) -> list[torch.nn.Module]:
    return [block for name in block_lists_of(expert) for block in getattr(expert, name)]


def _runs_compiled(block: torch.nn.Module) -> bool:
    return runs_forward(block, compiled_forward(type(block)))


def apply_regional_compile(expert: torch.nn.Module, enabled: bool) -> int:
    """Has every block of `expert` run the compiled forward (`enabled`) or the eager one; returns how many blocks."""
    blocks = _blocks(expert)
    for block in blocks:
        if enabled:
            install_forward(block, compiled_forward(type(block)))
        else:
            remove_forward(block, compiled_forward(type(block)))
    return len(blocks)


def _hinted_forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb, control_hidden_states_list):
    # The functor's own forward is the block's forward and then this hint step (cache-dit 1.5.3), kept out of the
    # compiled graph because `_i` differs per block.
    hidden_states = compiled_forward(type(self))(self, hidden_states, encoder_hidden_states, temb, rotary_emb)
    if self._i in self._vace_layers:
        control_hint, scale = control_hidden_states_list.pop()
        hidden_states = hidden_states + control_hint * scale
    return hidden_states


@contextlib.contextmanager
def compiled_cached_blocks(experts: list[torch.nn.Module]) -> Iterator[None]:
    """For one cached run (entered after cache-dit, inside it): the blocks cache-dit's functor patched run the
    compiled forward plus the functor's hint step. Leaving it puts the functor's forwards back."""
    patched = [
        (block, instance_forward(block))
        for expert in experts
        for block in expert.blocks
        if "_i" in block.__dict__ and instance_forward(block) is not None
    ]
    if experts and not patched:
        raise WanVACEInputError(
            "compile is on but cache-dit's WanVACE functor did not patch the blocks this version of the pack expects; "
            "turn compile or the cache off, or report this with your cache-dit version."
        )
    for block, _ in patched:
        install_forward(block, _hinted_forward)
    try:
        yield
    finally:
        for block, forward in patched:
            set_instance_forward(block, forward)


@functools.cache
def compile_failure(device: str) -> str | None:
    """Why `torch.compile` cannot build kernels for `device` (no Triton for the GPU, no C++ compiler for the CPU),
    or None; tried once per device and process."""
    where = torch.device(device)
    try:
        out = torch.compile(_probe)(torch.ones(8, device=where))
    except Exception as error:  # any failure of the compiler chain means compile cannot run here
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    if not bool((out == 3).all()):
        return "its probe kernel gave a wrong result"
    return None


def _probe(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def check_regional_compile(device: torch.device | str) -> None:
    """Refuses compile where torch.compile cannot build kernels for `device`."""
    problem = compile_failure(str(torch.device(device)))
    if problem is None:
        return
    remedy = (
        "It needs Triton on a GPU (pip install triton; triton-windows on Windows) or a C++ compiler for the CPU. "
        "Turn compile off."
    )
    torch_folder = Path(torch.__file__).parent
    if torch.device(device).type == "cpu" and " " in str(torch_folder):
        # Inductor passes torch's include and library folders to the C++ compiler unquoted.
        remedy = (
            f"torch is under a folder whose path has a space ({torch_folder}), which torch's C++ kernel build cannot "
            "use: run from a Python environment whose path has none, or turn compile off."
        )
    raise WanVACEInputError(
        f"compile is on but torch.compile cannot build kernels for {torch.device(device)} ({problem}). {remedy}"
    )
