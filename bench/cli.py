"""The command-line arguments the CPU benches share: the video's size, the steps, and how often a run repeats."""

from __future__ import annotations

import argparse

import torch


def bench_arguments(
    doc: str,
    *,
    steps: int,
    width: int,
    height: int,
    length: int,
    threads: int = 2,
    repeats: int | None = None,
    rounds: int | None = None,
) -> argparse.ArgumentParser:
    """A parser described by `doc`'s first line, with these defaults; add a bench's own arguments to it."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--height", type=int, default=height)
    parser.add_argument("--length", type=int, default=length)
    parser.add_argument("--threads", type=int, default=threads, help="intra-op threads (of each process)")
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats)
    if rounds is not None:
        parser.add_argument("--rounds", type=int, default=rounds, help="runs of each option, interleaved")
    return parser


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments, with torch's intra-op threads set from --threads."""
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args
