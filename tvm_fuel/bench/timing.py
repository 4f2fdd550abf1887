"""How the end-to-end rows time their contenders: side by side, in blocks that take turns.

Contents:
    in_blocks      -- run each contender in blocks of consecutive runs, the blocks taking turns
    SETTLE_SECONDS -- a ``settle`` that outlasts PyTorch's spinning OpenMP threads
"""

from __future__ import annotations

import time
from typing import Callable

SETTLE_SECONDS = 0.3  # PyTorch's OpenMP pool spins up to 200 ms after a parallel job


def in_blocks(fns: dict[str, Callable[[], None]], runs: dict, *, rounds: int = 3, block: int | dict[str, int] = 3,
              settle: float = 0.0) -> None:
    """Run each of ``fns`` ``block`` times in a row (or ``block[name]`` times), in turns for
    ``rounds`` rounds (the order reversed every round); each run appends its result to
    ``runs[name]``, and the first of every block is dropped there: TVM's and PyTorch's thread pools
    both spin a while after a parallel job, and a run right after the other's pays for those
    spinning threads. ``settle``: seconds to sleep before each block, where a run is so short that
    even the block's later runs would share the cores with the other's spinning threads (PyTorch's
    OpenMP pool spins up to 200 ms; a run of microseconds then loses a 4-8 ms scheduler tick)."""
    order = list(fns)
    for _ in range(rounds):
        for name in order:
            if settle:
                time.sleep(settle)
            for index in range(block[name] if isinstance(block, dict) else block):
                fns[name]()
                if index == 0:
                    runs[name].pop()
        order.reverse()

__all__ = ["SETTLE_SECONDS", "in_blocks"]
