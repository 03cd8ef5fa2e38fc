"""One CFG step of our expert against ComfyUI's own Wan VACE model (`comfy.ldm.wan.model.VaceWanModel`) on the same
weights, in one process, at two token counts, each side at its default and at its best settings.

    .venvs/current/bin/python bench/bench_vs_native.py [--dim 512 --heads 4 --layers 8 --threads 2 --repeats 5]

The weights are a random-weight expert written in diffusers' layout and loaded by our loader (so our side is the
runtime the nodes use); ComfyUI's model gets the same tensors under their original Wan names. A CFG step is two
calls of batch 1 (separate passes) or one call of batch 2 (batched). What runs on each side:

- ours, default: separate passes, attention `native` (today's default);
- ours, best: `batched_cfg` on, attention `auto` (`native` on a CPU);
- ours, compiled: the best settings plus `compile` (each block's forward compiled; compiled in the warm-up);
- ComfyUI, default: its sampler batches cond and uncond when memory allows (one call of batch 2); on a CPU
  without flags its attention is sub-quadratic (`attention_sub_quad`);
- ComfyUI, best: batched, PyTorch SDPA (`--use-pytorch-cross-attention`).

Runs interleave (ours, theirs, ...) and the medians are compared; the outputs of both models are checked to agree.
Needs the current set's ComfyUI tree (`$WANVACE_COMFY_DIR`, else `.cache/comfyui-current`), used in place.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.comfy_wan import comfy_vace_model  # noqa: E402
from wanvace_core import RuntimePlan, load_pipeline, replan  # noqa: E402
from wanvace_core.load.tiny import TinyModelSpec, write_tiny_pipeline  # noqa: E402

COMFY_DIR = Path(os.environ.get("WANVACE_COMFY_DIR", REPO / ".cache" / "comfyui-current"))
sys.path.append(str(COMFY_DIR))

from comfy.cli_args import args as comfy_args  # noqa: E402

comfy_args.cpu = not torch.cuda.is_available()  # as `main.py --cpu`: model_management asks for a GPU at import

import comfy.ldm.modules.attention as comfy_attention  # noqa: E402
import comfy.ldm.wan.model as comfy_wan  # noqa: E402

TEXT_TOKENS = 512


def _inputs(expert, frames: int, height: int, width: int, batch: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    config = expert.config
    dtype = expert.dtype
    return {
        "latents": torch.randn(batch, config.in_channels, frames, height, width, generator=generator).to(dtype),
        "timestep": torch.full((batch,), 700.0),
        "text": torch.randn(batch, TEXT_TOKENS, config.text_dim, generator=generator).to(dtype),
        "control": torch.randn(batch, config.vace_in_channels, frames, height, width, generator=generator).to(dtype),
    }


def _ours(expert, inputs: dict, scale: torch.Tensor) -> torch.Tensor:
    return expert(
        hidden_states=inputs["latents"],
        timestep=inputs["timestep"],
        encoder_hidden_states=inputs["text"],
        control_hidden_states=inputs["control"],
        control_hidden_states_scale=scale,
        return_dict=False,
    )[0]


def _theirs(model, inputs: dict, strength: float) -> torch.Tensor:
    return model(
        inputs["latents"],
        inputs["timestep"],
        inputs["text"],
        vace_context=inputs["control"][:, None],
        vace_strength=[strength],
    )


def _comfy_attention(function):
    """Sets the attention ComfyUI's Wan model calls (it imports `optimized_attention` by name at start-up)."""

    def choose() -> None:
        comfy_wan.optimized_attention = function

    return choose


def _split(inputs: dict) -> list[dict]:
    return [{name: value[index : index + 1] for name, value in inputs.items()} for index in range(2)]


OURS_DEFAULT, OURS_BEST = "ours default (separate, native)", "ours best (batched, auto)"
OURS_COMPILED = "ours compiled (batched, auto, compile)"
THEIRS_DEFAULT, THEIRS_BEST = "ComfyUI default (batched, sub-quad)", "ComfyUI best (batched, pytorch)"


def _bench_size(model, comfy_model, frames: int, height: int, width: int, repeats: int) -> None:
    expert = model.transformer
    scale = torch.ones(len(expert.config.vace_layers))
    tokens = frames * (height // 2) * (width // 2)
    pair = _inputs(expert, frames, height, width, batch=2)
    singles = _split(pair)
    check = (_ours(expert, pair, scale) - _theirs(comfy_model, pair, 1.0)).abs().max().item()
    replan(model, RuntimePlan(attention="auto", compile=True))
    compiled_check = (_ours(expert, pair, scale) - _theirs(comfy_model, pair, 1.0)).abs().max().item()

    def ours_default():
        for single in singles:
            _ours(expert, single, scale)

    def ours_best():
        _ours(expert, pair, scale)

    def theirs():
        _theirs(comfy_model, pair, 1.0)

    # name: (what to set before the timed call, the call)
    runs = {
        OURS_DEFAULT: (lambda: replan(model, RuntimePlan()), ours_default),
        OURS_BEST: (lambda: replan(model, RuntimePlan(attention="auto")), ours_best),
        OURS_COMPILED: (lambda: replan(model, RuntimePlan(attention="auto", compile=True)), ours_best),
        THEIRS_DEFAULT: (_comfy_attention(comfy_attention.attention_sub_quad), theirs),
        THEIRS_BEST: (_comfy_attention(comfy_attention.attention_pytorch), theirs),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for prepare, run in runs.values():  # warm-up
        prepare()
        run()
    for _ in range(repeats):
        for name, (prepare, run) in runs.items():
            prepare()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"\n{tokens} tokens ({frames}x{height}x{width} latent); ours vs ComfyUI max abs difference {check:.2e} "
        f"(compiled {compiled_check:.2e})"
    )
    for name, seconds in median.items():
        print(f"  {name:38s} {seconds * 1000:9.1f} ms")
    print(f"  ratio ComfyUI default / ours default : {median[THEIRS_DEFAULT] / median[OURS_DEFAULT]:.2f}x")
    print(f"  ratio ComfyUI best / ours best       : {median[THEIRS_BEST] / median[OURS_BEST]:.2f}x")
    print(f"  ratio ours separate / batched CFG    : {median[OURS_DEFAULT] / median[OURS_BEST]:.2f}x")
    print(f"  ratio ours eager / compiled          : {median[OURS_BEST] / median[OURS_COMPILED]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512, help="model width (heads x 128 in the real model)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--sizes", default="5x16x16,9x32x32", help="latent frames x height x width per token count, comma-separated"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    head_dim = args.dim // args.heads
    vace_every = 2
    spec = TinyModelSpec(
        two_experts=False,
        num_layers=args.layers,
        vace_layers=tuple(range(0, args.layers, vace_every)),  # ComfyUI spaces VACE layers evenly
        num_attention_heads=args.heads,
        attention_head_dim=head_dim,
        ffn_dim=4 * args.dim,
        text_dim=256,
    )
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        folder = write_tiny_pipeline(Path(tmp) / "bench-model", spec)
        model = load_pipeline(folder, args.dtype)
        expert = model.transformer
        comfy_model = comfy_vace_model(expert, dtype=expert.dtype)
        print(
            f"expert: dim {args.dim}, {args.heads} heads of {head_dim}, {args.layers} blocks + {len(spec.vace_layers)} "
            f"VACE blocks, {args.dtype}, {args.threads} threads, median of {args.repeats}; one CFG step (2 passes)"
        )
        for size in args.sizes.split(","):
            frames, height, width = (int(part) for part in size.split("x"))
            _bench_size(model, comfy_model, frames, height, width, args.repeats)


if __name__ == "__main__":
    main()
