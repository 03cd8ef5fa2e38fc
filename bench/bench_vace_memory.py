"""Peak host memory of one WanVACE forward: diffusers' stock forward (all hints first) vs ours (interleaved).

    .venvs/current/bin/python bench/bench_vace_memory.py [--tokens 16384] [--dim 512] [--vace-layers 8]

One subprocess, whose allocator returns every large block to the system when it is freed
(MALLOC_MMAP_THRESHOLD_) so that resident memory follows live tensors, imports torch and diffusers once and
forks a fresh copy per forward (before any tensor work: GNU OpenMP's pool does not survive a fork). Each copy
builds the model, runs a warm-up forward, and reports VmHWM after /proc/self/clear_refs reset it, minus the
RSS before the measured forward. One VACE hint is tokens x dim x 4 bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, torch
sys.path.insert(0, {repo!r})
from diffusers import WanVACETransformer3DModel
from bench.rss import run_forked
from wanvace_core.runtime.interleave import apply_interleaved_vace

def rss_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

def forward_peak(interleaved):
    torch.manual_seed(0)
    layers = {layers}
    vace_layers = list(range(0, layers, layers // {vace}))[: {vace}]
    model = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads={dim} // 64, attention_head_dim=64, in_channels=16,
        out_channels=16, text_dim=64, freq_dim=256, ffn_dim={dim} * 2, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=1024, vace_layers=vace_layers, vace_in_channels=96,
    ).eval()
    if interleaved:
        apply_interleaved_vace(model)
    frames, height, width = 4, 8 * 2 * 32, {tokens} // (4 * 32) * 2 * 8
    hidden = torch.randn(1, 16, frames, height // 8, width // 8)
    control = torch.randn(1, 96, frames, height // 8, width // 8)
    text = torch.randn(1, 32, 64)
    with torch.no_grad():
        model(hidden, torch.tensor([500]), text, control_hidden_states=control, return_dict=False)  # warm-up
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        before = rss_kb("VmRSS")
        out = model(hidden, torch.tensor([500]), text, control_hidden_states=control, return_dict=False)[0]
        peak = rss_kb("VmHWM")
    return {{"peak_above_kb": peak - before, "tokens": frames * (height // 16) * (width // 16),
            "checksum": float(out.double().sum())}}

results = [run_forked(forward_peak, interleaved) for interleaved in (False, True)]
if None in results:
    raise SystemExit("a forward failed (its traceback is above)")
print(json.dumps(results))
"""


def measure(args) -> tuple[dict, dict]:
    """(stock diffusers forward, interleaved forward): each one's peak above its start, token count, checksum."""
    code = _CHILD.format(repo=str(REPO), layers=args.layers, vace=args.vace_layers, dim=args.dim, tokens=args.tokens)
    env = {"OMP_NUM_THREADS": "2", "MALLOC_MMAP_THRESHOLD_": "65536"}
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if child.returncode != 0:
        raise RuntimeError(f"the measuring subprocess exited with {child.returncode}:\n{child.stderr[-4000:]}")
    stock, ours = json.loads(child.stdout.strip().splitlines()[-1])
    return stock, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vace-layers", type=int, default=8)
    args = parser.parse_args()
    stock, ours = measure(args)
    hint_mb = stock["tokens"] * args.dim * 4 / 2**20
    print(
        f"{args.layers} blocks, {args.vace_layers} VACE blocks, dim {args.dim}, {stock['tokens']} tokens, fp32; "
        f"one hint = {hint_mb:.1f} MB"
    )
    print(f"stock diffusers forward  peak above start {stock['peak_above_kb'] / 1024:8.1f} MB")
    print(f"interleaved forward      peak above start {ours['peak_above_kb'] / 1024:8.1f} MB")
    saved = (stock["peak_above_kb"] - ours["peak_above_kb"]) / 1024
    print(f"saved {saved:.1f} MB = {saved / hint_mb:.1f} hints; outputs equal: {stock['checksum'] == ours['checksum']}")


if __name__ == "__main__":
    main()
