"""`specbudget train-drafter`'s options (light: the CLI builds its parser from them
without importing torch)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from spec_decode.methods import get_method, method_names

# Drafts per chain a head is trained for: more than this is never served (the budget
# rule and the head's accuracy both make longer chains useless).
MAX_TRAIN_DEPTH = 16


def at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], refused at parse time (before the
    data phase, which takes minutes)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            limit = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {limit}, got {value}")
        return value
    return parse


def non_negative(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive(text: str) -> float:
    """An argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def trainable_methods() -> tuple[str, ...]:
    """The registered methods with a head to train (a `train_layout`): `--method`'s
    choices, read when the parser is built."""
    return tuple(name for name in method_names() if get_method(name).train_layout is not None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", default="eagle", choices=trainable_methods())
    parser.add_argument("--model", default=None, help="target (default: the default model)")
    parser.add_argument("--num-speculative-tokens", type=at_least(1, MAX_TRAIN_DEPTH), default=4,
                        help="K the head is trained for: drafts per chain in training")
    parser.add_argument("--draft-vocab-size", type=at_least(1), default=8192,
                        help="at most the target's vocabulary (checked before any data)")
    # The minutes go to distinct data before updates: data is captured while the target
    # generates, decodes of like length share an attention call, and updates run under
    # bfloat16 autocast. Measured (README, eagle from the target's layer): 393,216
    # positions and 1,200 updates served a mean acceptance length of 1.87, 1,800
    # updates on the same data 1.90, 589,824 positions and 1,200 updates 2.00. 1,000
    # updates keep the command, data included, inside 30 minutes here.
    parser.add_argument("--tokens", type=at_least(1), default=589_824,
                        help="training positions (three quarters chat, a quarter code)")
    parser.add_argument("--updates", type=at_least(1), default=1000)
    parser.add_argument("--lr", type=positive, default=1e-3,
                        help="peak learning rate (linear warm-up, cosine decay to a tenth)")
    parser.add_argument("--max-prompts", type=at_least(1), default=None,
                        help="use only the first N training instructions")
    # ce by measurement (README): on the same data an eagle head served a mean
    # acceptance length of 1.45 with ce against 1.37 with kl at 64k tokens and 300
    # updates, and 1.63 against 1.64 at 262k and 1200, where kl's teacher logits
    # cost 1.7x the time per update.
    parser.add_argument("--loss", choices=("kl", "ce"), default="ce",
                        help="ce: the target's greedy token; kl: its distribution over "
                             "the draft vocabulary (soft targets)")
    parser.add_argument("--noise", type=non_negative, default=0.05,
                        help="Gaussian noise on the fed features, times each row's RMS")
    parser.add_argument("--weight-decay", type=non_negative, default=0.0,
                        help="AdamW's decoupled weight decay")
    # By measurement (README): started as the target's layer L, an eagle head served a
    # mean acceptance length of 1.87 against 1.79 from a random start, parallel 1.69
    # against 1.59, dflash 1.39 against 1.44 (its second draft 0.06 against 0.11).
    parser.add_argument("--init", choices=("target", "random"), default=None,
                        help="the head's decoder layer at the start: the target's layer "
                             "whose input it reads last, or random (default: random for "
                             "dflash, target for the rest)")
    parser.add_argument("--head-layers", type=at_least(1), default=1,
                        help="the head's decoder layers (EAGLE-3's is one); from the "
                             "target, the later ones start as the target's layers after L")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="the target's dtype while generating data (default: what "
                             "the engine serves in)")
    # 128 by measurement (README; benchmarks/data_rate.py, 512 instructions): 9 % more
    # answer tokens a second than 64 (the matmuls run nearer their peak), 256 no faster
    # than 64. Where the fastest kernel is row-invariant (the Zen 5), the data is the
    # same bits at any size (on an AMX CPU, at the same size: training/pipeline.py).
    parser.add_argument("--generate-batch", type=at_least(1), default=128,
                        help="requests the target answers at once while generating data")
    parser.add_argument("--served-prompts", type=at_least(0), default=24,
                        help="held-out instructions served with the new head after "
                             "training, against speculation off (0: skip)")
    parser.add_argument("--served-max-tokens", type=at_least(1), default=64,
                        help="tokens each served answer runs to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="output dir (default: the model cache)")
    parser.add_argument("--no-progress", action="store_true")


def head_init(method: str, init: str | None) -> str:
    """`--init` as given, or the method's measured default (its class's `train_init`)."""
    return init or get_method(method).train_init
