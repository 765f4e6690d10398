"""`specbudget train-drafter`'s options (light: the CLI builds its parser from them
without importing torch)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", default="eagle", choices=("eagle", "mtp", "parallel",
                                                              "dflash"))
    parser.add_argument("--model", default=None, help="target (default: the default model)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4,
                        help="K the head is trained for: drafts per chain in training")
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=64_000,
                        help="training positions (three quarters chat, a quarter code)")
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--max-prompts", type=int, default=None,
                        help="use only the first N training instructions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="output dir (default: the model cache)")
    parser.add_argument("--no-progress", action="store_true")
