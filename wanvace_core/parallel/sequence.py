"""Ulysses sequence parallelism for one WanVACE expert, installed with module hooks and processor wrappers.

Every rank of a Ulysses group runs the expert's forward on the same inputs and gets the same output, but
inside the blocks it holds only its `1/degree` slice of the video tokens (contiguous, in rank order):

- the patch-embedded video is split at the input of the main blocks and of every VACE block (each VACE
  block reads it), the control tokens at the input of `vace_blocks.0`; the VACE hints then come out
  already split, matching the main branch they are added to;
- self-attention (`attn1`) trades tokens for heads with one all-to-all per q, k and v: each rank then
  attends over the whole sequence with `heads / degree` heads, and a fourth all-to-all hands every rank
  its own tokens back, with all heads, for the output projection;
- cross-attention (`attn2`) attends from the local tokens to the whole text: no communication. The text
  (`encoder_hidden_states`) is never split;
- `proj_out`'s output is all-gathered, so unpatchifying sees the whole sequence.

Self-attention runs diffusers' own `WanAttnProcessor` unchanged, on a view of the attention module whose
`norm_q`, `norm_k` and `to_v` end in the tokens-to-heads exchange, whose `heads` is `heads / degree` and
whose output projection starts with the heads-to-tokens exchange. q/k normalisation (an RMSNorm over all
heads of one token) therefore stays local and exact, and the rotary embedding is applied after the
exchange to the whole sequence, so the `rope` output is used unsplit.

The main blocks' split sits on `blocks.0`, where the interleaved forward (`interleave.py`) enters them.
While caching is on, cache-dit's forward swaps `expert.blocks` for a list holding one wrapper that runs
every main block and compares its own input with the first blocks' output, so there the split moves to
that wrapper's input and both tensors are shards. cache-dit averages its residual statistics over the
default process group, so every rank makes the same cache decision, and (equal shards) the same one as a
single process.

Inference only: the collectives are not differentiable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from ..errors import WanVACEError, WanVACEInputError
from ..hooks import ModuleHooks
from .options import divisors

_INSTALLED = "_wanvace_ulysses"


class WanVACESequenceParallelError(WanVACEError, RuntimeError):
    """The expert is built in a way the Ulysses hooks cannot split exactly; refused rather than run wrong."""


@dataclass(frozen=True)
class SequenceShards:
    """One rank's place in a Ulysses group and the exchanges along the token axis (dim 1 of `[B, S, C]`)."""

    group: dist.ProcessGroup
    degree: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> SequenceShards:
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def local(self, sequence: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of the tokens."""
        length = sequence.shape[1] // self.degree
        return sequence.narrow(1, self.rank * length, length)

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's slice, concatenated back into the whole sequence."""
        shards = [torch.empty_like(shard) for _ in range(self.degree)]
        dist.all_gather(shards, shard.contiguous(), group=self.group)
        return torch.cat(shards, dim=1)

    def tokens_to_heads(self, shard: torch.Tensor) -> torch.Tensor:
        """`[B, S/d, H*D]` (local tokens, all heads) -> `[B, S, H/d*D]` (all tokens, this rank's head group)."""
        batch, length, inner = shard.shape
        # Heads are the outer factor of the inner dim, so head group g is the g-th contiguous piece.
        send = shard.reshape(batch, length, self.degree, inner // self.degree).permute(2, 0, 1, 3).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        # received[r] holds rank r's tokens of this rank's head group; rank order is token order.
        return received.permute(1, 0, 2, 3).reshape(batch, self.degree * length, inner // self.degree)

    def heads_to_tokens(self, heads: torch.Tensor) -> torch.Tensor:
        """`[B, S, H/d*D]` -> `[B, S/d, H*D]`: the inverse of `tokens_to_heads`."""
        batch, tokens, group_inner = heads.shape
        length = tokens // self.degree
        send = heads.reshape(batch, self.degree, length, group_inner).transpose(0, 1).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        # received[r] holds head group r of this rank's tokens.
        return received.permute(1, 2, 0, 3).reshape(batch, length, self.degree * group_inner)


class _HeadGroupAttention:
    """What the stock processor sees of one `attn1`: the same module, exchanging tokens for heads around
    the attention itself. Everything not overridden here is the real module's."""

    def __init__(self, attn: torch.nn.Module, shards: SequenceShards) -> None:
        self._attn = attn
        self._shards = shards
        self.heads = attn.heads // shards.degree
        self.to_out = (self._output_projection, attn.to_out[1])

    def __getattr__(self, name: str):
        return getattr(self._attn, name)

    def norm_q(self, query: torch.Tensor) -> torch.Tensor:
        return self._shards.tokens_to_heads(self._attn.norm_q(query))

    def norm_k(self, key: torch.Tensor) -> torch.Tensor:
        return self._shards.tokens_to_heads(self._attn.norm_k(key))

    def to_v(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._shards.tokens_to_heads(self._attn.to_v(hidden_states))

    def _output_projection(self, attended: torch.Tensor) -> torch.Tensor:
        return self._attn.to_out[0](self._shards.heads_to_tokens(attended))


class UlyssesSelfAttention:
    """`attn1`'s processor while Ulysses is on: the module's own stock processor, run on `_HeadGroupAttention`."""

    def __init__(self, stock: WanAttnProcessor, shards: SequenceShards) -> None:
        self.stock = stock
        self.shards = shards

    # diffusers' `set_attention_backend` writes the backend onto whatever processor is installed.
    @property
    def _attention_backend(self):
        return self.stock._attention_backend

    @_attention_backend.setter
    def _attention_backend(self, backend) -> None:
        self.stock._attention_backend = backend

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None, **kwargs):
        view = _HeadGroupAttention(attn, self.shards)
        return self.stock(view, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)


@dataclass
class _Installed:
    """What `apply_ulysses` changed on one expert, so `remove_ulysses` can put it back."""

    shards: SequenceShards
    first_block: torch.nn.Module
    processors: list[tuple[torch.nn.Module, object]] = field(default_factory=list)
    hooks: ModuleHooks = field(default_factory=ModuleHooks)
    call_hooks: ModuleHooks = field(default_factory=ModuleHooks)  # for one call: under cache-dit's block wrapper
    tokens: int = 0


def _self_attentions(expert: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [
        (f"{name}.{index}.attn1", block.attn1)
        for name in ("blocks", "vace_blocks")
        for index, block in enumerate(getattr(expert, name))
    ]


def _refuse_unsplittable(expert: torch.nn.Module, degree: int) -> None:
    heads = expert.config.num_attention_heads
    if heads % degree:
        raise WanVACEInputError(
            f"ulysses_degree={degree} does not divide the model's {heads} attention heads; valid choices "
            f"(they must also divide the devices of a branch): {', '.join(map(str, divisors(heads)))}."
        )
    for name, attn in _self_attentions(expert):
        if type(attn.processor) is not WanAttnProcessor:
            raise WanVACESequenceParallelError(
                f"{name} uses {type(attn.processor).__name__}; Ulysses wraps diffusers' WanAttnProcessor only. "
                "Reset the expert's attention processors (expert.set_attn_processor(WanAttnProcessor())) first."
            )
        if attn.fused_projections:
            raise WanVACESequenceParallelError(
                f"{name} has fused q/k/v projections, which leave no point to exchange v between ranks; "
                "call expert.unfuse_qkv_projections() before turning Ulysses on."
            )


def _video_tokens(expert: torch.nn.Module, video_shape: torch.Size) -> tuple[int, str]:
    """Tokens of a latent video `[B, C, F, H, W]` after patch embedding, and how they arise (for messages)."""
    counts = [size // patch for size, patch in zip(video_shape[2:], expert.config.patch_size, strict=True)]
    return math.prod(counts), f"{counts[0]} latent frames x {counts[1]} x {counts[2]} patches"


def _argument(args: tuple, kwargs: dict, index: int, name: str):
    return kwargs[name] if name in kwargs else args[index]


def _with_argument(args: tuple, kwargs: dict, index: int, name: str, value) -> tuple[tuple, dict]:
    if name in kwargs:
        return args, {**kwargs, name: value}
    return (*args[:index], value, *args[index + 1 :]), kwargs


def _split_if_whole(installed: _Installed, args: tuple, kwargs: dict, index: int, name: str) -> tuple[tuple, dict]:
    """Splits the argument when it still holds the whole sequence; a shard (already split upstream) passes."""
    sequence = _argument(args, kwargs, index, name)
    if sequence.shape[1] != installed.tokens:
        return args, kwargs
    return _with_argument(args, kwargs, index, name, installed.shards.local(sequence))


def apply_ulysses(expert: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Runs `expert` (a WanVACETransformer3DModel) sequence-parallel over `group`; idempotent.

    Call it outside a sampling run (cache-dit's wrapper must not be in place yet). Every rank of `group`
    must call the expert with the same inputs; each gets the whole output. Refuses heads that `group`'s
    size does not divide here, and, at each call, a video whose tokens it does not divide.
    """
    installed: _Installed | None = getattr(expert, _INSTALLED, None)
    if installed is not None:
        if installed.shards.group is group:
            return
        remove_ulysses(expert)
    shards = SequenceShards.of(group)
    _refuse_unsplittable(expert, shards.degree)
    installed = _Installed(shards=shards, first_block=expert.blocks[0])

    # Every forward (ours, diffusers', cache-dit's) calls `rope` on the latent video first, and cache-dit's
    # forward has swapped its block wrapper in by then (it does so inside the forward, after module pre-hooks).
    def check_and_note_tokens(_module, args):
        tokens, origin = _video_tokens(expert, args[0].shape)
        if tokens % shards.degree:
            heads = expert.config.num_attention_heads
            valid = ", ".join(map(str, divisors(math.gcd(tokens, heads))))
            raise WanVACEInputError(
                f"ulysses_degree={shards.degree} does not divide this video's {tokens} tokens ({origin}); the "
                "tokens are split evenly across the Ulysses ranks, never padded. Change the width, height or "
                f"length, or use a ulysses_degree that divides both the tokens and the {heads} heads: {valid}."
            )
        installed.tokens = tokens
        # Under cache-dit `blocks.0` is its wrapper around all main blocks (see the module docstring).
        entry = expert.blocks[0]
        if entry is not installed.first_block:
            installed.call_hooks.pre(entry, split_video, with_kwargs=True)

    def forget_call(_module, _args, _kwargs, _output):
        installed.call_hooks.remove()

    def split_video(_module, args, kwargs):
        return _split_if_whole(installed, args, kwargs, 0, "hidden_states")

    def split_video_and_control(_module, args, kwargs):
        args, kwargs = _split_if_whole(installed, args, kwargs, 0, "hidden_states")
        return _split_if_whole(installed, args, kwargs, 2, "control_hidden_states")

    def gather_output(_module, _args, output):
        return shards.gather(output)

    installed.hooks.pre(expert.rope, check_and_note_tokens)
    installed.hooks.post(expert, forget_call, with_kwargs=True, always_call=True)
    installed.hooks.pre(installed.first_block, split_video, with_kwargs=True)
    installed.hooks.post(expert.proj_out, gather_output)
    for block in expert.vace_blocks:
        installed.hooks.pre(block, split_video_and_control, with_kwargs=True)
    for _name, attn in _self_attentions(expert):
        installed.processors.append((attn, attn.processor))
        attn.set_processor(UlyssesSelfAttention(attn.processor, shards))
    setattr(expert, _INSTALLED, installed)


def remove_ulysses(expert: torch.nn.Module) -> None:
    """Undoes `apply_ulysses`: hooks removed, the original processor objects back (a no-op if not applied)."""
    installed: _Installed | None = expert.__dict__.pop(_INSTALLED, None)
    if installed is None:
        return
    installed.call_hooks.remove()
    installed.hooks.remove()
    for attn, processor in installed.processors:
        attn.set_processor(processor)


def ulysses_group(expert: torch.nn.Module) -> dist.ProcessGroup | None:
    """The group `expert` runs sequence-parallel over, or None."""
    installed: _Installed | None = getattr(expert, _INSTALLED, None)
    return None if installed is None else installed.shards.group
