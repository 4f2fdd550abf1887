"""Rules that put the CUDA kernels in place of the floor for fuel calls on cuda targets.

A rule serves sm_80 and newer (tensor cores for float16/bfloat16: register tiles through
``ldmatrix`` + ``mma.sync``; bfloat16 needs sm_80) and declines
(the floor, scheduled by dlight, then serves the call) when no tile shape fits the architecture's
shared memory. ``emulated=True`` gives the same rules for llvm targets, building each kernel's
one-thread emulation (``Launch.emulated``): how the tests check the CUDA kernels' numerics on
machines without a GPU.

Contents:
    CudaFlashForward, CudaFlashBackward, CudaPagedAttention, CudaVarlenForward, CudaVarlenBackward -- one rule
                      per kernel pattern
    cuda_rules(emulated=False)
    arch_of, shared_memory_fits
"""

from __future__ import annotations

import itertools
import re
import warnings
from math import gcd
from dataclasses import asdict, replace

import tvm
from tvm import tirx

from tvm_fuel.diagnostics import FloorWarning
from ..base import KernelRule, Knobs
from ..workload import Workload
from .device import HALF_TYPES, Launch, padded_dim, shared_memory_per_block
from .forward import dense_forward, paged_forward
from .varlen import varlen_forward
from .varlen_backward import varlen_backward
from .tiles import (CudaTiles, WarpLayout, backward_registers, backward_smem, backward_strips, forward_smem,
                    streaming_multiprocessors)

STATIC_SHARED_LIMIT = 48 * 1024
SPLIT_GRID_LIMIT = 16  # blocks per SM beyond which knob_points tries no split-KV
MAX_ACCUMULATORS = 64  # float32 accumulators per thread that SIMT kernels keep without spilling (ptxas)
MAX_REGISTER_TILES = 128  # float32 fragment elements per thread of a register-tile forward (no spills, ptxas)
MAX_BACKWARD_TILES = 160  # the same for the backward (dK, dV, S^T, dP^T: 192 at hdim 128 spilled at 255 registers)
EMULATED_ARCH = "sm_90"  # the architecture whose limits the emulated kernels obey


def arch_of(target: tvm.target.Target) -> str | None:
    """``sm_XY`` of a cuda target (None when it has no arch or is older than sm_80)."""
    arch = str(target.attrs.get("arch", "") or "")
    match = re.fullmatch(r"sm_(\d+)a?", arch)
    return f"sm_{match.group(1)}" if match and int(match.group(1)) >= 80 else None


def shared_memory_fits(static: int, dynamic: int, limit: int) -> bool:
    """Whether a block's (static, dynamic) shared-memory bytes fit ``limit`` (a block's maximum)
    and can be launched: TVM 0.27's CUDA runtime raises a kernel's dynamic limit past the
    driver's default (48 KiB less the static bytes) only for more than 48 KiB of dynamic memory,
    so between the two a launch fails (CUDA_ERROR_INVALID_VALUE, seen on an H200: float32 D64,
    8448 static + 40960 dynamic bytes)."""
    launchable = dynamic > STATIC_SHARED_LIMIT or static + dynamic <= STATIC_SHARED_LIMIT
    return static <= STATIC_SHARED_LIMIT and static + dynamic <= limit and launchable


class _CudaRule(KernelRule):
    smem = staticmethod(forward_smem)

    def __init__(self, *, emulated: bool = False):
        self.emulated = emulated
        self.target_kinds = ("llvm",) if emulated else ("cuda",)

    def is_target_available(self, target: tvm.target.Target) -> bool:
        return super().is_target_available(target) and (self.emulated or arch_of(target) is not None)

    def _arch(self, target: tvm.target.Target) -> str:
        return EMULATED_ARCH if self.emulated else arch_of(target)

    def _shared_limit(self, target: tvm.target.Target) -> int:
        return shared_memory_per_block(None if self.emulated else target, self._arch(target))

    def launch(self, knobs: Knobs) -> Launch:
        return Launch.emulated() if self.emulated else Launch(knobs["threads"])

    def check_knobs(self, workload: Workload, knobs: Knobs) -> str | None:
        try:
            tiles = CudaTiles(**knobs)
        except (TypeError, ValueError) as err:
            return str(err)
        return self.tensor_core_problem(tiles) if workload.spec.dtype in HALF_TYPES else None

    def tensor_core_problem(self, tiles: CudaTiles) -> str | None:
        """Why float16/bfloat16 tiles cannot be spread over the block's warps (register tiles)."""
        return WarpLayout.of(tiles).problem(tiles)

    def accumulators(self, workload: Workload, tiles: CudaTiles) -> int:
        """float32 accumulators each thread keeps in registers: its share of the O tile, or on
        tensor cores its S and O fragments."""
        if workload.spec.dtype in HALF_TYPES:
            return WarpLayout.of(tiles).registers(workload.spec.head_dim)
        return -(-tiles.block_q * padded_dim(workload.spec.head_dim) // tiles.threads)

    def register_limit(self) -> int:
        return MAX_REGISTER_TILES

    def check_fit(self, workload: Workload, target: tvm.target.Target, knobs: Knobs) -> str | None:
        """Why ``knobs`` do not fit ``target``'s shared memory, or None when they do."""
        tiles, spec, limit = CudaTiles(**knobs), workload.spec, self._shared_limit(target)
        static, dynamic = self.smem(spec.dtype, spec.head_dim, tiles)
        if not shared_memory_fits(static, dynamic, limit):
            return (f"tiles {tiles.block_q}x{tiles.block_k} need {static} + {dynamic} bytes of shared memory, "
                    f"more than the {limit} {self._arch(target)} gives a block")
        return None

    def knobs(self, workload: Workload, target: tvm.target.Target, tuned: Knobs | None = None) -> dict[str, int]:
        full = super().knobs(workload, target, tuned)
        problem = self.check_fit(workload, target, full)
        if problem:
            raise ValueError(f"{self.op}: {problem}")
        return full

    def knob_points(self, workload: Workload, target: tvm.target.Target) -> list[dict[str, int]]:
        """Every point of the knob space that builds and fits the target's shared memory and
        registers (no more accumulators per thread than ptxas keeps without spilling, or than
        the hand-picked point holds), the hand-picked point first: what the tune stage measures."""
        defaults = self.default_knobs(workload, target)
        most = max(self.register_limit(), self.accumulators(workload, CudaTiles(**defaults)))
        space = self.knob_space(workload, target)
        sms = streaming_multiprocessors(self._arch(target))
        points = [self.knobs(workload, target, {name: defaults[name] for name in space})]
        for values in itertools.product(*space.values()):
            try:
                knobs = self.knobs(workload, target, dict(zip(space, values)))
            except ValueError:
                continue
            tiles = CudaTiles(**knobs)
            if knobs in points or self.accumulators(workload, tiles) > most:
                continue
            # split-KV pays only while the grid is short of the GPU; past that it only adds merging
            blocks = self._blocks(workload, tiles) if "splits" in space else None
            if tiles.splits > 1 and blocks is not None and blocks * tiles.splits > SPLIT_GRID_LIMIT * sms:
                continue
            points.append(knobs)
        return points

    def _fitting(self, workload: Workload, target: tvm.target.Target, candidates) -> CudaTiles | None:
        """The first candidate tile shape whose shared memory and registers fit the target; where
        none keeps to the register budget (large head dims: at 256 the O fragment alone is 128
        floats a thread), the first of those needing the fewest accumulators (the forward at 256:
        32 x 32 on four warps, where the last candidate would run one warp; the backward's fewest
        is its 16 x 16 tile, now two stages deep)."""
        spec, limit = workload.spec, self._shared_limit(target)
        fitting = [tiles for tiles in candidates if self.check_knobs(workload, asdict(tiles)) is None
                   and shared_memory_fits(*self.smem(spec.dtype, spec.head_dim, tiles), limit)]
        if not fitting:
            return None
        budget = max(self.register_limit(), min(self.accumulators(workload, tiles) for tiles in fitting))
        return next(tiles for tiles in fitting if self.accumulators(workload, tiles) <= budget)

    def _candidates(self, workload: Workload) -> list[CudaTiles]:
        half = workload.spec.dtype in HALF_TYPES
        shapes = [(64, 64), (64, 32), (32, 32), (16, 16)] if half else [(32, 32), (32, 16), (16, 16)]
        # half precision: a tile shape pipelined two deep, else loaded tile by tile, before a smaller
        # shape; float32 (S and P in shared memory too): any shape pipelined before none is, since
        # at D 64 its 32x32 two-stage block is one TVM's runtime cannot launch (shared_memory_fits)
        order = ([(shape, stages) for shape in shapes for stages in (2, 1)] if half
                 else [(shape, stages) for stages in (2, 1) for shape in shapes])
        return [CudaTiles(block_q=bq, block_k=bk, stages=stages, threads=self._threads(workload, bq, bk))
                for (bq, bk), stages in order]

    def _threads(self, workload: Workload, block_q: int, block_k: int) -> int:
        """128 threads, fewer where tensor-core warps would outnumber the tile's 16-row strips and
        16-key slices."""
        if workload.spec.dtype not in HALF_TYPES:
            return 128
        return 32 * min(4, block_q // 16 * (block_k // 16))

    def _blocks(self, workload: Workload, tiles: CudaTiles) -> int | None:
        """Thread blocks of one split: batch x KV heads x row tiles (None where a dim is symbolic)."""
        batch, sq = workload.dim["B"], workload.dim.get("Sq")
        if batch is None or sq is None:
            return None
        return batch * workload.spec.num_kv_heads * -(-sq * workload.spec.group // tiles.block_q)

    def _splits(self, workload: Workload, target: tvm.target.Target, tiles: CudaTiles, keys: int | None) -> int:
        """Split-KV: enough blocks for every SM twice over when (batch x heads x row tiles) is short."""
        blocks = self._blocks(workload, tiles)
        if blocks is None or keys is None:
            return 1
        want = -(-2 * streaming_multiprocessors(self._arch(target)) // blocks)
        return max(1, min(16, want, -(-keys // (4 * tiles.block_k))))  # >= 4 key tiles per split

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        tiles = self._fitting(workload, target, self._candidates(workload))
        if tiles is None:
            raise ValueError(f"{self.op}: no tile shape fits the shared memory of {self._arch(target)}")
        return asdict(self._tuned_defaults(workload, target, tiles))

    def _tuned_defaults(self, workload: Workload, target: tvm.target.Target, tiles: CudaTiles) -> CudaTiles:
        return tiles

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        default = self.default_knobs(workload, target)
        space = {"block_q": (16, 32, 64, 128), "block_k": (16, 32, 64), "splits": (1, 2, 4, 8, 16),
                 "threads": (32, 64, 128, 256), "stages": (1, 2, 3)}  # 32: one warp per 16 x 16 tile
        return {name: tuple(sorted(set(values) | {default[name]})) for name, values in space.items()}

    def serves(self, workload: Workload, target: tvm.target.Target) -> bool:
        """Its op on an available target, where some tile shape fits a block's shared memory (else a
        ``FloorWarning`` says the floor serves the call)."""
        if not super().serves(workload, target):
            return False
        if self._fitting(workload, target, self._candidates(workload)) is None:
            smallest = min(sum(self.smem(workload.spec.dtype, workload.spec.head_dim, tiles))
                           for tiles in self._candidates(workload) if self.check_knobs(workload, asdict(tiles)) is None)
            warnings.warn(f"tvm_fuel: {workload.describe()} on {self._arch(target)}: no tile shape "
                          f"fits a block's {self._shared_limit(target)} bytes of shared memory (the smallest needs "
                          f"{smallest}); the floor serves this call", FloorWarning, stacklevel=2)
            return False
        return True


class CudaFlashForward(_CudaRule):
    """flash_attn on cuda: Q tiles per block, K/V tiles through shared memory, online softmax."""

    op = "flash_attn"

    def _tuned_defaults(self, workload, target, tiles):
        return replace(tiles, splits=self._splits(workload, target, tiles, workload.dim["Sk"]))

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        return dense_forward(workload.spec, CudaTiles(**knobs), launch=self.launch(knobs),
                             dims=workload.dim if static else None)


class CudaPagedAttention(_CudaRule):
    """paged_attn on cuda: key tiles read through the block table, live blocks only, split-KV."""

    op = "paged_attn"

    def _candidates(self, workload: Workload) -> list[CudaTiles]:
        sq = workload.dim["Sq"]
        rows = None if sq is None else sq * workload.spec.group
        if rows is not None and rows <= 16:  # decode: one 16-row tile holds every query head of the group
            return [CudaTiles(block_q=16, block_k=bk, stages=stages, threads=self._threads(workload, 16, bk))
                    for bk in (64, 32, 16) for stages in (2, 1)]
        return super()._candidates(workload)

    def _tuned_defaults(self, workload, target, tiles):
        max_blocks = workload.dim["max_blocks"]
        keys = None if max_blocks is None else max_blocks * workload.spec.block_size
        return replace(tiles, splits=self._splits(workload, target, tiles, keys))

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        return paged_forward(workload.spec, CudaTiles(**knobs), launch=self.launch(knobs),
                             dims=workload.dim if static else None)


class CudaVarlenForward(_CudaRule):
    """flash_attn_varlen on cuda: the dense forward's blocks over each sequence's rows (a block
    finds its sequence by a search over the offsets), no split-KV. Hand-picked tiles: the dense
    forward's; not tuned yet."""

    op = "flash_attn_varlen"
    tunable = False

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        return {**super().knob_space(workload, target), "splits": (1,)}

    def _blocks(self, workload: Workload, tiles: CudaTiles) -> int | None:
        return None  # the rows per sequence are known at run time only

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        return varlen_forward(workload.spec, CudaTiles(**knobs), launch=self.launch(knobs))


class CudaFlashBackward(_CudaRule):
    """flash_attn_backward (and single-gradient forms) on cuda: FlashAttention-2 backward with a
    separate deterministic dQ pass. Takes the forward's out and lse (``needs_forward_state``)."""

    needs_forward_state = True
    smem = staticmethod(backward_smem)

    def __init__(self, op: str, *, emulated: bool = False):
        super().__init__(emulated=emulated)
        self.op = op

    def accumulators(self, workload: Workload, tiles: CudaTiles) -> int:
        """Each thread's share of the dK and dV tiles (SIMT) or of the larger kernel's fragments."""
        if workload.spec.dtype in HALF_TYPES:
            return backward_registers(workload.spec.head_dim, tiles)
        return -(-2 * tiles.block_k * padded_dim(workload.spec.head_dim) // tiles.threads)

    def register_limit(self) -> int:
        return MAX_BACKWARD_TILES

    def tensor_core_problem(self, tiles: CudaTiles) -> str | None:
        return backward_strips(tiles)

    def _threads(self, workload: Workload, block_q: int, block_k: int) -> int:
        # every warp owns whole 16-row strips of the keys and of the queries
        return 32 * gcd(4, block_q // 16, block_k // 16) if workload.spec.dtype in HALF_TYPES else 128

    def _tuned_defaults(self, workload, target, tiles):
        # a float32 tile with more accumulators than MAX_ACCUMULATORS spills: such tiles run 256 threads
        spills = self.accumulators(workload, tiles) > MAX_ACCUMULATORS
        return replace(tiles, threads=256) if workload.spec.dtype not in HALF_TYPES and spills else tiles

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        return {name: values for name, values in super().knob_space(workload, target).items() if name != "splits"}

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        from .backward import flash_backward

        return flash_backward(workload.spec, CudaTiles(**knobs), grads=workload.grads, launch=self.launch(knobs),
                              dims=workload.dim if static else None)


class CudaVarlenBackward(CudaFlashBackward):
    """flash_attn_varlen_backward on cuda: the dense backward's three kernels over each sequence's
    rows (a block finds its sequence by a search over the offsets). Takes the forward's out and
    lse; hand-picked tiles and shared-memory limits: the dense backward's; not tuned yet."""

    tunable = False

    def __init__(self, *, emulated: bool = False):
        super().__init__("flash_attn_varlen_backward", emulated=emulated)

    def _blocks(self, workload: Workload, tiles: CudaTiles) -> int | None:
        return None  # the rows per sequence are known at run time only

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        return varlen_backward(workload.spec, CudaTiles(**knobs), launch=self.launch(knobs))


def cuda_rules(*, emulated: bool = False) -> tuple[KernelRule, ...]:
    """The CUDA rules in priority order (``emulated``: their llvm emulation, for tests)."""
    return (CudaFlashForward(emulated=emulated), CudaPagedAttention(emulated=emulated),
            CudaVarlenForward(emulated=emulated), CudaVarlenBackward(emulated=emulated),
            *(CudaFlashBackward(op, emulated=emulated) for op in (
                "flash_attn_backward", "flash_attn_backward_q", "flash_attn_backward_k", "flash_attn_backward_v")))


RULES = cuda_rules()

__all__ = ["RULES", "STATIC_SHARED_LIMIT", "cuda_rules", "arch_of", "shared_memory_fits"]
