"""Rules that put the CPU kernels in place of the floor for fuel calls on llvm targets.

A tuning record is matched by target key (instruction set and vector width), not by core count:
``port_knobs`` re-derives the knobs that set the task count (``tiles.CORE_KNOBS``) for the core
count of the machine that uses the record:

- the backward's ``splits`` keeps the record's tasks per core (splits x cores here / cores there):
  the tuner chose how finely to cut each (batch, KV head)'s keys for load balance, per core;
- decode's ``kv_heads`` keeps its ratio to the hand-picked rule (record x rule here / rule there):
  the rule chunks a task's heads only so that every core gets a task (whole page rows read
  fastest), so a record's departure from it is kept and the chunking redone for this machine.

Both land on the nearest (log scale) value the knob space offers that builds the kernel. A knob a
record left at its machine's hand-picked value outside the candidates (e.g. decode's prefetch,
derived from the KV heads per task) takes this machine's hand-picked value.

Contents:
    FlashForward, FlashBackward, PagedAttention, VarlenForward, VarlenBackward, FlashJvp, FlashDoubleBackward,
    NormBackward --
        one rule per kernel pattern (dlight style)
"""

from __future__ import annotations

from dataclasses import asdict, replace

import tvm
from tvm import tirx

from ..base import KernelRule, Knobs
from ..workload import Workload
from .backward import flash_backward
from .backward_rows import RowsTask, rows_backward
from .decode import dense_decode_forward, dense_rows_forward
from .forward import dense_forward
from .paged import paged_forward
from .double_backward import flash_double_backward
from .varlen import varlen_forward
from .varlen_backward import varlen_backward
from .tangent import flash_jvp
from .norm import NormTiles, norm_backward, norm_tiles
from .tiles import (CORE_KNOBS, STREAMING_ROWS, CpuTiles, cores, fit_keys, fit_rows, nearest, streaming_space,
                    tile_space, tiles_for)


def _rows(workload: Workload) -> int | None:
    """Static query rows of one KV head's tasks (positions x heads of the group)."""
    sq = workload.dim["Sq"]
    return None if sq is None else sq * workload.spec.group


class _CpuRule(KernelRule):
    target_kinds = ("llvm",)

    def check_knobs(self, workload: Workload, knobs: Knobs) -> str | None:
        try:
            tiles = CpuTiles(**knobs)
        except (TypeError, ValueError) as err:
            return str(err)
        if tiles.lanes & (tiles.lanes - 1):
            return f"lanes {tiles.lanes} is not a power of two"
        if workload.spec.num_kv_heads % tiles.kv_heads:
            return f"kv_heads {tiles.kv_heads} does not divide the {workload.spec.num_kv_heads} KV heads"
        return None

    def port_knobs(self, workload: Workload, knobs: Knobs, tuned_on: tvm.target.Target,
                   target: tvm.target.Target) -> dict[str, int]:
        """The knobs of a record tuned on ``tuned_on`` (same target key) for ``target``: the core
        knobs re-derived for ``target``'s core count (module docstring), the others as recorded.
        Unchanged where the core counts agree; ``rule.knobs`` still checks the result."""
        ported = dict(knobs)
        if cores(tuned_on) == cores(target):
            return ported
        space, ours = self.knob_space(workload, target), self.default_knobs(workload, target)
        theirs = self.default_knobs(workload, tuned_on)
        for name, value in knobs.items():
            if name in space and value not in space[name] and value == theirs.get(name) != ours.get(name):
                ported[name] = ours[name]  # the record kept its machine's hand-picked value
        for name in CORE_KNOBS:
            if name not in knobs or name not in space:
                continue
            want = self.scaled_core_knob(name, knobs[name], cores(tuned_on), cores(target),
                                         theirs[name], ours[name])
            # the space's values and the hand-picked one, within the space's range (the hand-picked
            # splits, 2 tasks per core, may exceed the key tiles on many cores)
            low, high = min(space[name]), max(space[name])
            candidates = [c for c in sorted({*space[name], ours[name]}) if low <= c <= high
                          and self.check_knobs(workload, {**ours, **ported, name: c}) is None]
            if candidates:
                ported[name] = nearest(want, candidates)
        return ported

    def scaled_core_knob(self, name: str, value: int, theirs_cores: int, ours_cores: int,
                         theirs_rule: int, ours_rule: int) -> float:
        """A core knob's value for ``ours_cores`` from the record's ``value`` at ``theirs_cores``
        (before rounding to a candidate); ``*_rule``: the hand-picked value at each count."""
        if name == "splits":  # tasks per core kept
            return value * ours_cores / theirs_cores
        return value * ours_rule / theirs_rule  # kv_heads: the record's factor over the rule kept


class _DenseRule(_CpuRule):
    """Shared by the dense kernels: a register-tiled space."""

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        return tile_space(target, rows=_rows(workload))


class FlashForward(_DenseRule):
    """flash_attn on llvm: tiled online softmax, K/V packed once per KV head; decode-shaped calls
    (``_streams``: few static rows per KV head) stream their keys in place (``decode``), and calls
    over a handful of keys (``_short_rows``) take their rows one at a time."""

    op = "flash_attn"

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        spec, rows = workload.spec, _rows(workload)
        if _streams(workload):
            tiles = tiles_for(target, head_dim=spec.head_dim, rows=min(rows, STREAMING_ROWS),
                              num_kv_heads=spec.num_kv_heads, batch=workload.dim["B"])
            # a head's keys are one contiguous run here (not pages): the hardware prefetchers follow
            # it. The key loops take a vector of keys at a time (key_vecs is the GEMMs')
            tiles = replace(tiles, prefetch=0, key_vecs=1)
        else:
            tiles = tiles_for(target, head_dim=spec.head_dim, rows=rows)
        return asdict(fit_keys(tiles, workload.dim["Sk"]))

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        if _streams(workload):
            return streaming_space(target, num_kv_heads=workload.spec.num_kv_heads)
        return super().knob_space(workload, target)

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        if _short_rows(workload):  # a handful of keys: rows one at a time, no key tiles
            return dense_rows_forward(workload.spec, CpuTiles(**knobs), dims=workload.dim if static else None)
        if _streams(workload):
            # Sq is static wherever a call streams (its rows chose the path): the row loops unroll
            dims = workload.dim if static else {"Sq": workload.dim["Sq"]}
            return dense_decode_forward(workload.spec, CpuTiles(**knobs), dims=dims)
        return dense_forward(workload.spec, CpuTiles(**knobs), dims=workload.dim if static else None)


SHORT_KEYS = 16  # a call of at most this many static keys streams up to two tasks of rows per KV head


def _streams(workload: Workload) -> bool:
    """Whether a dense forward call is decode-shaped: few enough static rows per KV head to stream
    (STREAMING_ROWS a task), or up to twice that over at most SHORT_KEYS keys (B 2048 x S 16: 48-51 ms
    streamed in two row tiles against 75-133 ms packed, and half the memory)."""
    rows, keys = _rows(workload), workload.dim["Sk"]
    if rows is None:
        return False
    return rows <= STREAMING_ROWS or (rows <= 2 * STREAMING_ROWS and keys is not None and keys <= SHORT_KEYS)


def _short_rows(workload: Workload) -> bool:
    """Whether a call takes its rows one at a time against every key (``decode.dense_rows_forward``,
    ``backward_rows``): at most SHORT_KEYS keys and 2 * STREAMING_ROWS queries (a dense call's static
    Sk and Sq, a varlen call's max_seqlen). Kernels side by side at B 2048, H 8, D 64 causal on Zen 5
    (ms): forward rows against streaming S1 0.25 / 0.48, S4 2.2 / 5.7, S16 14 / 30; backward rows
    against tiles S1 1.1 / 6.3, S4 4.4 / 13.8, S8 19 / 30, S16 48 / 51."""
    dims = workload.dim
    sq, sk = (dims["max_seqlen_q"], dims["max_seqlen_k"]) if "max_seqlen_q" in dims else (dims["Sq"], dims["Sk"])
    return sq is not None and sk is not None and sq <= 2 * STREAMING_ROWS and sk <= SHORT_KEYS


class FlashBackward(_DenseRule):
    """flash_attn_backward (and its single-gradient forms) on llvm: one pass over the key tiles.

    The kernel takes the forward's out and lse; where the call lacks them the forward kernel
    runs first (``needs_forward_state``).
    """

    needs_forward_state = True

    def __init__(self, op: str):
        self.op = op

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        batch = workload.dim["B"]
        # enough (batch, kv head, split) tasks for every core twice over; one split when unknown
        splits = 1 if batch is None else max(1, -(-2 * cores(target) // (batch * workload.spec.num_kv_heads)))
        tiles = tiles_for(target, head_dim=workload.spec.head_dim, rows=None)
        # query and key tiles no longer than the call's static Sq and Sk need (one-row sequences)
        tiles = fit_rows(fit_keys(tiles, workload.dim["Sk"]), workload.dim["Sq"])
        return asdict(replace(tiles, splits=1 if _short_rows(workload) else splits))

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        space = tile_space(target, rows=None)
        sk = workload.dim["Sk"]
        most = 16 if sk is None else max(1, -(-sk // 32))  # no more splits than key tiles
        return {**space, "splits": tuple(n for n in (1, 2, 4, 8, 16) if n <= most)}

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        kernel = rows_backward if _short_rows(workload) else flash_backward
        return kernel(workload.spec, CpuTiles(**knobs), grads=workload.grads, dims=workload.dim if static else None)


class PagedAttention(_CpuRule):
    """paged_attn on llvm: key tiles read through the block table, live blocks only."""

    op = "paged_attn"

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        spec = workload.spec
        return asdict(tiles_for(target, head_dim=spec.head_dim, rows=_rows(workload),
                                num_kv_heads=spec.num_kv_heads, batch=workload.dim["B"],
                                element_bytes=tvm.DataType(spec.dtype).bits // 8))

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        rows = _rows(workload)
        if rows is not None and rows <= STREAMING_ROWS:
            return streaming_space(target, num_kv_heads=workload.spec.num_kv_heads)
        return tile_space(target, rows=rows)

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        return paged_forward(workload.spec, CpuTiles(**knobs), dims=workload.dim if static else None)


class VarlenForward(_CpuRule):
    """flash_attn_varlen on llvm: the ragged prefill's two phases (every sequence's key tiles packed
    once per KV head, then (sequence, KV head, row tile) tasks over the tiles they see). A call whose
    max_seqlen_q bounds every sequence to at most STREAMING_ROWS rows per KV head streams its keys in
    place instead, in tiles fitted to max_seqlen_k (no packing, no workspace: 2048 one-token
    sequences cost their own keys, not a tile each), and one whose max_seqlen are a handful
    (``_short_rows``) takes its rows one at a time. Not tuned yet: its hand-picked knobs are the
    dense forward's at rows unknown, or the dense decode-shaped forward's."""

    op = "flash_attn_varlen"
    tunable = False

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        longest = workload.dim["max_seqlen_q"]
        rows = None if longest is None else longest * workload.spec.group
        if rows is None or rows > STREAMING_ROWS:
            return asdict(tiles_for(target, head_dim=workload.spec.head_dim, rows=None))
        tiles = tiles_for(target, head_dim=workload.spec.head_dim, rows=rows)
        # one KV head a task, k's rows read in place: no prefetch past the strided rows (as dense decode)
        tiles = replace(tiles, kv_heads=1, prefetch=0, key_vecs=1)
        return asdict(fit_keys(tiles, workload.dim["max_seqlen_k"]))

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        return tile_space(target, rows=None)

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        return varlen_forward(workload.spec, CpuTiles(**knobs), rows=_short_rows(workload))


class VarlenBackward(_CpuRule):
    """flash_attn_varlen_backward on llvm: the dense backward's key-split tasks per (sequence, KV
    head, split), dealt to the cores. Takes the forward's out and lse (the varlen forward kernel runs
    first where the call lacks them). Not tuned yet: the dense backward's hand-picked tiles at rows
    unknown, and splits enough for every core twice over from one sequence's KV heads (the longest
    sequence's work dominates; a sequence never has more splits than key tiles)."""

    op = "flash_attn_varlen_backward"
    needs_forward_state = True
    tunable = False

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        # at most 4: the dq partials hold splits x (total_q + B * block_q) rows per head, whatever
        # the batch (B is known at run time only; many sequences need no splits to fill the cores)
        splits = min(4, max(1, -(-2 * cores(target) // workload.spec.num_kv_heads)))
        tiles = tiles_for(target, head_dim=workload.spec.head_dim, rows=None)
        # tiles no longer than the call's max_seqlen need (each task zeroes and walks whole tiles:
        # 2048 one-token sequences in 128-key tiles cost 430 ms against the floor's 16)
        tiles = fit_rows(fit_keys(tiles, workload.dim["max_seqlen_k"]), workload.dim["max_seqlen_q"])
        return asdict(replace(tiles, splits=1 if _short_rows(workload) else splits))

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        return {**tile_space(target, rows=None), "splits": (1, 2, 4, 8, 16)}

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        tiles = CpuTiles(**knobs)
        rows = RowsTask(workload.spec, tiles, workload.grads) if _short_rows(workload) else None
        return varlen_backward(workload.spec, tiles, rows_task=rows)


class FlashJvp(_DenseRule):
    """flash_attn_jvp on llvm: one online-softmax pass per query tile carrying the tangent's sums;
    the kernel is specialised on which tangents the call passes (``Workload.grads``)."""

    op = "flash_attn_jvp"

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        tiles = tiles_for(target, head_dim=workload.spec.head_dim, rows=None)
        sq = workload.dim["Sq"]
        if sq is not None and sq < tiles.block_q:  # a task holds one head's rows: no taller than Sq
            tiles = replace(tiles, block_q=-(-sq // tiles.micro_rows) * tiles.micro_rows)
        return asdict(tiles)

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        return tile_space(target, rows=workload.dim["Sq"])

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        return flash_jvp(workload.spec, CpuTiles(**knobs), tangents=workload.grads,
                         dims=workload.dim if static else None)


class FlashDoubleBackward(FlashBackward):
    """flash_attn_double_backward on llvm: a tangent pass per query tile (row statistics and
    do_grad), then the backward's pass over the key tiles differentiated; specialised on which
    cotangents the call passes. Takes the forward's out and lse like the backward."""

    def __init__(self):
        super().__init__("flash_attn_double_backward")

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        return flash_double_backward(workload.spec, CpuTiles(**knobs), cotangents=workload.grads,
                                     dims=workload.dim if static else None)


class NormBackward(KernelRule):
    """layer_norm_backward / rms_norm_backward on llvm: one pass over each row with the saved
    statistics, rows split across the cores. Memory-bound with one sweep of dy and x: its knobs
    (vector width, one task per core) are hand-picked, not tuned. Needs a static C."""

    target_kinds = ("llvm",)
    tunable = False

    def __init__(self, op: str):
        self.op = op
        self.kind = "layer" if op == "layer_norm_backward" else "rms"

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        return asdict(norm_tiles(target, workload.spec.dtype, workload.spec.features, kind=self.kind))

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        return {}

    def check_knobs(self, workload: Workload, knobs: Knobs) -> str | None:
        try:
            NormTiles(**knobs)
        except (TypeError, ValueError) as err:
            return str(err)
        return None

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        rows = workload.dim["N"] if static else None
        return norm_backward(self.kind, workload.spec.dtype, workload.spec.features, NormTiles(**knobs), rows=rows)


RULES = (FlashForward(), PagedAttention(), VarlenForward(), VarlenBackward(), *(FlashBackward(op) for op in (
    "flash_attn_backward", "flash_attn_backward_q", "flash_attn_backward_k", "flash_attn_backward_v")),
    FlashJvp(), FlashDoubleBackward(), NormBackward("layer_norm_backward"), NormBackward("rms_norm_backward"))
