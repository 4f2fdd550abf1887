"""How the end-to-end rows time their contenders: side by side, in blocks that take turns.

Contents:
    in_blocks -- run each contender in blocks of consecutive runs, the blocks taking turns
"""

from __future__ import annotations

from typing import Callable


def in_blocks(fns: dict[str, Callable[[], None]], runs: dict, *, rounds: int = 3, block: int = 3) -> None:
    """Run each of ``fns`` ``block`` times in a row, in turns for ``rounds`` rounds (the order
    reversed every round); each run appends its result to ``runs[name]``, and the first of every
    block is dropped there: TVM's and PyTorch's thread pools both spin a while after a parallel
    job, and a run right after the other's pays for those spinning threads."""
    order = list(fns)
    for _ in range(rounds):
        for name in order:
            for index in range(block):
                fns[name]()
                if index == 0:
                    runs[name].pop()
        order.reverse()


__all__ = ["in_blocks"]
