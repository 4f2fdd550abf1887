"""How the CUDA kernels meet the hardware: launch shape, memory scopes, syncs and tile GEMMs.

A CUDA kernel of tvm_fuel is one thread program per thread block: streamed tiles are staged
in shared memory through a ``cp.async`` pipeline, every thread keeps its share of the
accumulators in registers, and the phases of a tile are separated by ``__syncthreads``. The
GEMMs of float16/bfloat16 kernels are warp register tiles (``schedules.cuda.mma``: ldmatrix +
mma.sync); float32 kernels use ``TileOps.gemm``'s SIMT loop and per-thread dot products.

``Launch.emulated()`` gives the same thread program with one thread per block, serial blocks
and global scratch: it builds for llvm, so the tests check every CUDA kernel's tiling, masking,
split-KV merge and block-table walk against the reference on machines without a GPU (register
tiles run lane by lane there; the split of the copies over threads only runs on a device).

Contents:
    Launch   -- threads per block / emulation; grid and thread loops; scopes
    Rows     -- a row range of a tile buffer (one pipeline stage) used as a tile
    TileOps  -- sync, tile copies (cp.async where asked), commit/wait of copy groups, the
                multi-stage copy pipeline, SIMT tile GEMM for one launch and input dtype
    SHARED_MEMORY_LIMIT -- bytes of shared memory a block may use per architecture (fallback)
    shared_memory_per_block -- the target's limit, else the table's
    padded_dim
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from tvm import tirx
from tvm.script import tirx as T

F32 = "float32"
HALF_TYPES = ("float16", "bfloat16")
WARP = 32
MMA = 16  # tensor-core tile edge (rows of a strip, k of mma.m16n8k16)
# columns added to the half-precision tiles ldmatrix reads: a row of 2 * (n + 8) bytes keeps 16-byte
# alignment and puts the 8 rows one ldmatrix phase reads in 8 different bank groups
TILE_PAD = 8

# opt-in dynamic shared memory per block (CUDA programming guide, compute capabilities table): the
# fallback where the target does not say (its max_shared_memory_per_block)
SHARED_MEMORY_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024}


def shared_memory_per_block(target, arch: str) -> int:
    """Bytes of shared memory a block of ``target`` may use: its ``max_shared_memory_per_block``
    where the target gives it, else the architecture's opt-in maximum (the smallest known for an
    unknown architecture)."""
    given = None
    if target is not None and target.kind.name == "cuda":
        given = target.attrs.get("max_shared_memory_per_block")
    if given is not None and int(given) > 0:
        return int(given)
    return SHARED_MEMORY_LIMIT.get(arch, min(SHARED_MEMORY_LIMIT.values()))


def padded_dim(head_dim: int) -> int:
    """Head dim rounded up to the tensor-core tile edge (padding columns are zero)."""
    return -(-head_dim // MMA) * MMA


@dataclass(frozen=True)
class Launch:
    """Threads per block of a kernel, or its emulation on llvm (one thread, serial blocks)."""

    threads: int = 128
    emulate: bool = False

    @staticmethod
    def emulated() -> Launch:
        return Launch(threads=1, emulate=True)

    @property
    def warps(self) -> int:
        return max(1, self.threads // WARP)

    @property
    def shared(self) -> str:
        # one dynamic allocation: tiles may exceed the 48 KiB of static shared memory
        return "global" if self.emulate else "shared.dyn"

    @property
    def small_shared(self) -> str:
        # row state and page ids: static shared memory. TVM's sync planner treats all dynamic
        # shared buffers as one (they are merged), so a thread writing its own alpha and shift
        # under a condition would look like a race; static buffers are told apart.
        return "global" if self.emulate else "shared"

    @property
    def local(self) -> str:
        return "global" if self.emulate else "local"

    def grid(self, extent, axis: str):
        """Loop over the thread blocks along ``axis`` (x, y, z)."""
        return T.serial(T.Cast("int32", extent)) if self.emulate else T.thread_binding(
            T.Cast("int32", extent), thread=f"blockIdx.{axis}")

    def block(self):
        """Loop over the threads of a block (its variable is the thread index)."""
        return T.serial(1) if self.emulate else T.thread_binding(self.threads, thread="threadIdx.x")

    def owned(self, n: int):
        """Loop over the ``n`` accumulator elements a thread owns: unrolled on the device, so they
        stay in registers (the emulation's single thread owns every element: serial)."""
        return T.serial(n) if self.emulate else T.unroll(n)



@dataclass(frozen=True)
class Rows:
    """Rows ``[row0, row0 + rows)`` of a tile buffer, used as a tile of its own (one stage of a
    multi-stage K/V buffer): copies write it, the GEMMs and loops read it as they read a buffer
    (``shape``, ``scope``, ``access_ptr``, ``[r, c]``)."""

    buffer: tirx.Buffer
    row0: tirx.PrimExpr
    rows: int

    @property
    def shape(self) -> tuple:
        return (self.rows, self.buffer.shape[1])

    def scope(self) -> str:
        return self.buffer.scope()

    def access_ptr(self, mode: str, offset=0):
        return self.buffer.access_ptr(mode, offset=self.row0 * self.buffer.shape[1] + offset)

    def __getitem__(self, index):
        row, column = index
        return self.buffer[self.row0 + row, column]

    @staticmethod
    def stage(buffer: tirx.Buffer, index, rows: int) -> Rows:
        """Stage ``index`` of a multi-stage tile buffer ([stages * rows, columns])."""
        return Rows(buffer, index * rows, rows)


class TileOps:
    """The macros a kernel body uses, specialised to one launch and one input dtype."""

    def __init__(self, launch: Launch, dtype: str):
        self.launch, self.dtype = launch, dtype

        @T.macro
        def sync():
            if not launch.emulate:
                T.tvm_storage_sync("shared")

        @T.macro
        def commit():
            # closes the group of cp.async copies issued since the last commit (an empty group counts too)
            if not launch.emulate:
                T.ptx.cp.async_.commit_group()

        def wait(pending: int):
            @T.macro
            def wait_group():
                # until at most ``pending`` committed groups are still in flight (this thread's copies)
                if not launch.emulate:
                    T.ptx.cp.async_.wait_group(pending)

            return wait_group

        self.sync, self.commit, self.wait = sync, commit, wait

    def zero_nonfinite(self, rows: int, width: int):
        """Macro ``zero_nonfinite(X, row0, flags, flag, tx)``: ``flags[flag] = 1`` if rows ``row0 ..
        row0 + rows`` (``width`` columns) of a shared tile hold a NaN or Inf, and then those become
        0. Tensor cores cannot skip a zero weight (the NaN rule, tvm_fuel.op.semantics): a tile an
        mma multiplies by weights that may be 0 is zeroed first, and its non-finite elements are
        added back, to the rows that weigh them, by ``WarpTiles.nonfinite_terms``. The caller
        resets the flag before (and a barrier separates the reset from this). A finite tile costs
        a read-only pass (a compare per element) and two barriers; only a flagged tile runs the
        pass that writes (TVM's sync planner puts barriers inside a loop that reads and writes the
        merged dynamic shared memory, two per element step)."""
        NT = self.launch.threads
        sync = self.sync
        # whole steps (tiles are 16-multiples squared, at most 256 threads): no bound check in the
        # writing pass, whose barriers may not sit inside a condition
        if rows * width % NT:
            raise ValueError(f"zero_nonfinite: a {rows} x {width} tile is no whole number of {NT}-thread steps")

        @T.macro
        def zero_nonfinite(X, row0, flags, flag, tx):
            for i in range((rows * width + NT - 1) // NT):
                if i * NT + tx < rows * width:
                    # into a register first: the planner takes no shared load in a condition
                    x: T.float32 = T.Cast(F32, X[row0 + (i * NT + tx) // width, (i * NT + tx) % width])
                    if not T.isfinite(x):
                        flags[flag] = 1  # every writer writes 1: no order needed
            sync()
            # the writing pass runs 0 times on a finite tile: a loop, not a condition, because the
            # planner puts barriers inside it and takes none inside a condition (flagged is the
            # same for every thread, so every thread meets them)
            flagged: T.int32 = flags[flag]
            for i in range(flagged * (rows * width // NT)):
                y: T.float32 = T.Cast(F32, X[row0 + (i * NT + tx) // width, (i * NT + tx) % width])
                if not T.isfinite(y):
                    X[row0 + (i * NT + tx) // width, (i * NT + tx) % width] = T.Cast(self.dtype, 0)
            sync()

        return zero_nonfinite

    def pipeline(self, stages: int):
        """Macro ``pipeline(count, issue, compute)``: walks ``count`` tiles through a
        ``stages``-deep copy pipeline. ``issue(t, st)`` starts the copies of tile t into stage st
        (cp.async on the device); ``compute(t, st)`` uses tile t once it has landed. ``stages - 1``
        tiles are issued ahead and one more each step; a step waits for its own tile only (every
        thread commits one group per step, empty past the end), and the barrier before the
        next issue keeps a stage from being overwritten while it is read."""
        sync, commit, wait_for_tile = self.sync, self.commit, self.wait(stages - 1)

        @T.macro
        def pipeline(count, issue, compute):
            for t in range(stages - 1):
                if t < count:
                    issue(t, t)
                commit()
            for t in range(count):
                sync()  # the previous tile's readers are done with the stage about to be refilled
                if t + stages - 1 < count:
                    issue(t + stages - 1, (t + stages - 1) % stages)
                commit()
                wait_for_tile()
                sync()
                compute(t, t % stages)

        return pipeline

    @cached_property
    def threads(self) -> int:
        return self.launch.threads

    def copy(self, rows: int, width: int, padded: int, *, asynchronous: bool = False, vector: bool = True):
        """Macro ``copy(dst, valid, src, tx)``: dst[r, c] = src(r, c) for the ``rows`` x ``width``
        elements of a tile whose row r is ``valid(r)``, zero elsewhere up to ``padded`` columns.

        ``valid`` and ``src`` are Python functions of the tile row (and column) returning TIR
        expressions: each caller says where its rows come from (dense rows, pages of a cache).
        A thread moves 16 bytes per step where the width allows. ``asynchronous``: on the device
        the valid rows go through ``cp.async`` (16 bytes: ``.cg``, bypassing L1; 4 or 8: ``.ca``),
        addressed with 64-bit pointers (``src`` must be a buffer load): the caller commits and
        waits. Zero rows are plain stores either way. Without ``vector`` a thread's elements are
        computed one by one (a source that decodes 8-bit elements: CUDA's codegen mangles 32-bit
        integer vectors of 8 lanes).
        """
        NT = self.threads
        itemsize = 2 if self.dtype in HALF_TYPES else 4
        VW = next(w for w in (16 // itemsize, 4, 2, 1) if width % w == 0)
        CH = padded // VW  # vector chunks per row
        zero = T.Cast(self.dtype, 0)
        nbytes = VW * itemsize
        in_flight = asynchronous and not self.launch.emulate and nbytes in (4, 8, 16)
        cp_async = f"cp.async.{'cg' if nbytes == 16 else 'ca'}.shared.global"

        @T.macro
        def store(dst, row0, src, r, c0):
            if in_flight:
                T.ptx[cp_async](T.address_of(dst[row0 + r, c0]), T.address_of(src(r, c0)), nbytes)
            elif vector:
                for j in T.vectorized(VW):
                    dst[row0 + r, c0 + j] = src(r, c0 + j)
            else:
                for j in T.unroll(VW):
                    dst[row0 + r, c0 + j] = src(r, c0 + j)

        @T.macro
        def copy_rows(dst, row0, valid, src, tx):
            for i in range((rows * CH + NT - 1) // NT):
                if i * NT + tx < rows * CH:
                    if tirx.all(valid((i * NT + tx) // CH), (i * NT + tx) % CH * VW < width):
                        store(dst, row0, src, (i * NT + tx) // CH, (i * NT + tx) % CH * VW)
                    else:
                        for j in T.vectorized(VW):
                            dst[row0 + (i * NT + tx) // CH, (i * NT + tx) % CH * VW + j] = zero

        def copy(dst, valid, src, tx):
            if isinstance(dst, Rows):  # one stage of a multi-stage tile
                return copy_rows(dst.buffer, dst.row0, valid, src, tx)
            return copy_rows(dst, 0, valid, src, tx)

        return copy

    def gemm(self, M: int, N: int, K: int, *, a_trans: bool = False, b_trans: bool = False):
        """Macro ``gemm(C, A, B, tx)``: C[M, N] = A @ B in float32 (SIMT, one output element per
        thread at a time). A is [M, K] ([K, M] with ``a_trans``), B is [K, N] ([N, K] with
        ``b_trans``); C is overwritten."""
        NT = self.threads

        def a_at(A, r, k):
            return (A[k, r] if a_trans else A[r, k]).astype(F32)

        def b_at(B, k, c):
            return (B[c, k] if b_trans else B[k, c]).astype(F32)

        @T.macro
        def gemm(C, A, B, tx):
            acc = T.alloc_buffer((1,), F32, scope=self.launch.local)
            for i in range((M * N + NT - 1) // NT):
                if i * NT + tx < M * N:
                    acc[0] = T.float32(0)
                    for k in range(K):
                        acc[0] = acc[0] + a_at(A, (i * NT + tx) // N, k) * b_at(B, k, (i * NT + tx) % N)
                    C[(i * NT + tx) // N, (i * NT + tx) % N] = acc[0]

        return gemm
