"""CPU backward of layer norm and RMS norm over the last axis of a 2-D view, from the saved statistics.

The forward normalised each row n of x [N, C] with its mean[n] and rstd[n] (RMS norm: rstd[n]
alone). Per row, with x_hat = (x - mean[n]) * rstd[n] (RMS: x * rstd[n]) and g = dy * gamma:

    a = mean_C(g)            (layer norm only)
    b = mean_C(g * x_hat)
    dx = rstd[n] * (g - a - x_hat * b)          (RMS: no a)
    dgamma[c] = sum_n dy * x_hat,  dbeta[c] = sum_n dy

It is memory-bound: dy and x are read from memory once and dx is written once. ``tasks`` parallel
tasks (one per core) each own a contiguous run of ceil(N / tasks) rows, so each core streams one run.
A row takes two passes over its C columns: the first reads dy, x and gamma from memory into the
cache and takes the sums a, b and the task's dgamma/dbeta partial sums; the second reads them
again from L1/L2 and writes dx. The first pass sweeps ``block_rows`` rows together, so the
partials are loaded and stored once per sweep (wide rows, whose partials live in L2; narrow rows
go one at a time, whose partials stay in L1 and whose streams the hardware prefetcher follows
best). Both passes are vectorized over C, with a scalar tail when C is not a multiple of the
vector width.

The task partials [tasks, C] (accumulation type) are added per column in a second parallel stage,
in task order: the result does not depend on thread timing. Their traffic is tasks x C,
independent of N (partials per chunk of a fixed row count had cost ~20 % at C = 4096). Tasks
without rows (N < tasks) neither write nor add partials; N = 0 gives dgamma = dbeta = 0.

All arithmetic is in the accumulation type: float64 for float64 tensors, float32 otherwise.

Measured on Zen 5 (2 cores, float32, N in {4096, 16384}, C in {768, 4096}): 57-65 GB/s where the
data comes from DRAM, 0.6-0.7x the speed of torch.add(dy, x, out=dx) on the same arrays (the same
traffic in one pass); 1.7-14x faster than PyTorch's native_layer_norm_backward, 12-88x than
autograd's rms_norm backward, 15-100x than TVM's default build of the same math.

Contents:
    KINDS, DTYPES  -- the accepted kinds ("layer", "rms") and tensor dtypes
    accumulation_dtype -- float64 for float64 tensors, else float32
    NormTiles      -- the knobs: vector width, parallel task count, rows per sweep of the first pass
    norm_tiles     -- the hand-picked knobs for a target
    norm_backward  -- PrimFunc(dy, x, gamma, mean, rstd, dx, dgamma, dbeta) (layer norm) or
                      PrimFunc(dy, x, weight, rstd, dx, dweight) (RMS norm)
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..common import finish, shape_vars
from .micro import store_row_sums
from .tiles import cores, vector_lanes, vector_registers

KINDS = ("layer", "rms")
DTYPES = ("float32", "float16", "bfloat16", "float64")
UNKNOWN_CORES_TASKS = 8  # tasks of a target without num-cores


def accumulation_dtype(dtype: str) -> str:
    """float64 for float64 tensors, else float32: the type of every sum and of the statistics."""
    return "float64" if dtype == "float64" else "float32"


@dataclass(frozen=True)
class NormTiles:
    """The knobs of one norm-backward kernel.

    lanes       vector width in elements of the accumulation type (16 float32 with AVX-512)
    tasks       parallel tasks (a task count, not rows per task): each owns ceil(N / tasks)
                contiguous rows and a dgamma (and dbeta) partial of C accumulation-type values,
                added across tasks at the end. One per core: TVM's pool hands each thread a
                contiguous run of tasks anyway, so more tasks only add partials
    block_rows  rows the first pass sweeps together (a task's remaining rows go one at a time):
                the partials are loaded and stored once per sweep, in registers in between
    """

    lanes: int = 8
    tasks: int = 1
    block_rows: int = 1

    def __post_init__(self):
        if self.lanes < 1 or self.lanes & (self.lanes - 1):
            raise ValueError(f"NormTiles: lanes must be a power of two >= 1, got {self.lanes}")
        if self.tasks < 1:
            raise ValueError(f"NormTiles: tasks must be >= 1, got {self.tasks}")
        if self.block_rows < 1:
            raise ValueError(f"NormTiles: block_rows must be >= 1, got {self.block_rows}")


def norm_tiles(target: tvm.target.Target, dtype: str, hidden: int, *, kind: str = "layer") -> NormTiles:
    """Hand-picked knobs for ``kind`` norm over rows of ``hidden`` columns of ``dtype``:

    lanes       the target's widest vector in the accumulation type (``vector_lanes`` float32
                lanes; float64 gets half)
    tasks       one per core (``cores``: the target's num-cores; 8 when it has none)
    block_rows  1 while a task's partials (dgamma, and dbeta for layer norm, in the accumulation
                type) fit in 8 KiB, where they stay in L1 beside the rows; else 8 (4 with 16
                vector registers: 2 sums per row stay in registers)

    Measured on Zen 5 (2 cores, 48 KiB L1, float32, N * C = 2^26, layer norm): one row at a time
    is 10-30 % faster up to C = 1024 (interleaved rows defeat the hardware prefetcher), 8 rows are
    20-30 % faster from C = 1536 (the partials' loads and stores go to L2 once per 8 rows, not
    per row), and 8 beat 4 and 16 by 5-10 % at C = 4096. RMS norm (half the partials): one row
    is 7-20 % faster up to C = 2048. (The shared box's memory bandwidth varied 2x over hours;
    where it was low the differences shrank to within 5 %.)
    """
    _check_dtype(dtype, "norm_tiles")
    _check_kind(kind, "norm_tiles")
    if hidden < 1:
        raise ValueError(f"norm_tiles: hidden must be >= 1, got {hidden}")
    acc = accumulation_dtype(dtype)
    lanes = vector_lanes(target)
    if acc == "float64":
        lanes = max(1, lanes // 2)
    # a target that does not say its cores (plain "llvm") gets enough tasks for a typical host:
    # tasks without rows cost nothing, and a thread with several tasks streams them in order
    tasks = cores(target) if target.attrs.get("num-cores") else UNKNOWN_CORES_TASKS
    partial_bytes = (2 if kind == "layer" else 1) * hidden * tvm.runtime.DataType(acc).bits // 8
    block_rows = 1 if partial_bytes <= (8 << 10) else (8 if vector_registers(target) >= 32 else 4)
    return NormTiles(lanes=lanes, tasks=tasks, block_rows=block_rows)


def _check_kind(kind: str, where: str):
    if kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {KINDS}, got {kind!r}")


def _check_dtype(dtype: str, where: str):
    if dtype not in DTYPES:
        raise ValueError(f"{where}: dtype must be one of {DTYPES}, got {dtype!r}")


def norm_backward(kind: str, dtype: str, hidden: int, tiles: NormTiles, *, rows: int | None = None) -> tirx.PrimFunc:
    """The backward kernel of ``kind`` ("layer" or "rms") norm over rows of ``hidden`` columns.

    acc = float64 for float64 ``dtype``, else float32. N is symbolic (int64) unless ``rows`` is given.

    layer: (dy [N, C] dtype, x [N, C] dtype, gamma [C] dtype, mean [N] acc, rstd [N] acc,
            dx [N, C] dtype, dgamma [C] dtype, dbeta [C] dtype)
    rms:   (dy [N, C] dtype, x [N, C] dtype, weight [C] dtype, rstd [N] acc,
            dx [N, C] dtype, dweight [C] dtype)
    """
    _check_kind(kind, "norm_backward")
    _check_dtype(dtype, "norm_backward")
    if hidden < 1:
        raise ValueError(f"norm_backward: hidden must be >= 1, got {hidden}")
    if rows is not None and rows < 0:
        raise ValueError(f"norm_backward: rows must be >= 0, got {rows}")
    layer = kind == "layer"
    acc = accumulation_dtype(dtype)
    C, L, TASKS = hidden, tiles.lanes, tiles.tasks
    CV = C // L  # full vectors of a row; the remaining C % L columns are the scalar tail
    (N,) = shape_vars({"N": rows}, ("N",))
    R = (N + TASKS - 1) // TASKS  # rows per task
    used = (N + T.max(R, 1) - 1) // T.max(R, 1)  # tasks with rows: t < used <=> t * R < N
    K = tiles.block_rows
    WHICH = 2 if layer else 1  # partials per column: dgamma (and dbeta)
    SUM_ROWS = 1 << (2 * K - 1).bit_length()  # 2 sums per row, padded to a power of two (store_row_sums)

    BLOCK = L * max(1, min(16, -(-C // L)))  # columns per task of the final stage (one vector up to 16)
    blocks = -(-C // BLOCK)
    CP = blocks * BLOCK  # partial columns, padded so the final stage has no tail (the padding is never read out)

    def zero():
        return tirx.const(0, acc)

    def load(buffer, *index):
        return buffer[index].astype(acc)

    def x_hat(x, n, c, stat, r):
        # (x - mean) * rstd of row n (stat[r, :]): subtracting first keeps x_hat accurate when
        # |mean| >> std (x * rstd - mean * rstd would cancel); RMS norm has no mean
        value = load(x, n, c)
        return (value - stat[r, 1]) * stat[r, 0] if layer else value * stat[r, 0]

    @T.macro
    def sum_element(sums, stat, pa, dy, x, gamma, n, r, c, lane, pa_lane):
        # pass 1, row n (the sweep's r-th) at column c: the row's sums of g (layer) and g * x_hat
        # in lane `lane` of sums rows 2r, 2r + 1; dy * x_hat and dy added to the column's
        # partials pa[:, pa_lane]
        xh = T.meta_var(x_hat(x, n, c, stat, r))
        g = T.meta_var(load(dy, n, c) * load(gamma, c))
        if layer:
            sums[2 * r, lane] = sums[2 * r, lane] + g
            pa[1, pa_lane] = pa[1, pa_lane] + load(dy, n, c)
        sums[2 * r + 1, lane] = sums[2 * r + 1, lane] + g * xh
        pa[0, pa_lane] = pa[0, pa_lane] + load(dy, n, c) * xh

    @T.macro
    def sum_rows(sums, rowsum, stat, pa, part, dy, x, gamma, mean, rstd, n0, t, k: T.int32):
        # pass 1 over rows n0 .. n0 + k - 1 together, from memory. Per column vector the task's
        # partials are loaded once, take the k rows' terms in registers and are stored once (a
        # load and store per row had cost ~1/3 of the kernel at C = 4096, where they live in L2)
        for r in T.unroll(k):
            stat[r, 0] = rstd[n0 + r]
            stat[r, 1] = mean[n0 + r] if layer else zero()
        for i in range(SUM_ROWS):
            for v in T.vectorized(L):
                sums[i, v] = zero()
        for c0 in range(CV):
            for v in T.vectorized(L):
                for w in T.unroll(WHICH):
                    pa[w, v] = part[t, w, c0 * L + v]
            for r in T.unroll(k):
                for v in T.vectorized(L):
                    sum_element(sums, stat, pa, dy, x, gamma, n0 + r, r, c0 * L + v, v, v)
            for v in T.vectorized(L):
                for w in T.unroll(WHICH):
                    part[t, w, c0 * L + v] = pa[w, v]
        for c in range(CV * L, C):  # the tail: column c in lane c - CV * L
            for w in T.unroll(WHICH):
                pa[w, 0] = part[t, w, c]
            for r in T.unroll(k):
                sum_element(sums, stat, pa, dy, x, gamma, n0 + r, r, c, c - CV * L, 0)
            for w in T.unroll(WHICH):
                part[t, w, c] = pa[w, 0]
        # the lanes of each sum by one shuffle tree for all rows: rowsum[2r] (g), rowsum[2r + 1] (g * x_hat)
        store_row_sums(rowsum, sums, SUM_ROWS, L)
        for r in T.unroll(k):  # stat[r] = (rstd, mean, b, a) with b, a the row means
            stat[r, 2] = rowsum[2 * r + 1] / tirx.const(C, acc)
            stat[r, 3] = rowsum[2 * r] / tirx.const(C, acc) if layer else zero()

    @T.macro
    def grad_element(dx, dy, x, gamma, stat, n, r, c):
        # pass 2 at column c: dx = rstd * (g - a - x_hat * b) (the row is in cache); g - a first,
        # so a row whose x_hat is 0 (C = 1) gets dx = 0 exactly
        xh = T.meta_var(x_hat(x, n, c, stat, r))
        g = T.meta_var(load(dy, n, c) * load(gamma, c))
        dx[n, c] = ((g - stat[r, 3] - xh * stat[r, 2]) * stat[r, 0]).astype(dtype)

    @T.macro
    def grad_rows(dx, dy, x, gamma, stat, n0, k: T.int32):
        # pass 2 over rows n0 .. n0 + k - 1, one at a time (from L1/L2)
        for r in T.unroll(k):
            for c0 in range(CV):
                for v in T.vectorized(L):
                    grad_element(dx, dy, x, gamma, stat, n0 + r, r, c0 * L + v)
            for c in range(CV * L, C):
                grad_element(dx, dy, x, gamma, stat, n0 + r, r, c)

    @T.macro
    def task_rows(dy, x, gamma, mean, rstd, dx, part, t):
        # rows [t * R, min(t * R + R, N)) of task t, K at a time, the rest one at a time; its
        # partials zeroed first. A task past the last row (t >= used) does nothing.
        first: T.int64 = t * R
        count: T.int64 = T.min(first + R, N) - first
        if count > 0:
            for c0 in range(CP // L):
                for v in T.vectorized(L):
                    for w in T.unroll(WHICH):
                        part[t, w, c0 * L + v] = zero()
            sums = T.alloc_buffer((SUM_ROWS, L), acc, scope="local")  # lanes of row r's sums: 2r g, 2r + 1 g * x_hat
            rowsum = T.alloc_buffer((SUM_ROWS,), acc, scope="local")
            stat = T.alloc_buffer((K, 4), acc, scope="local")  # per row: rstd, mean, b, a
            pa = T.alloc_buffer((WHICH, L), acc, scope="local")  # a column vector's dgamma, dbeta partials
            for i in range(count // K):
                sum_rows(sums, rowsum, stat, pa, part, dy, x, gamma, mean, rstd, first + i * K, t, K)
                grad_rows(dx, dy, x, gamma, stat, first + i * K, K)
            for n in range(first + count // K * K, first + count):
                sum_rows(sums, rowsum, stat, pa, part, dy, x, gamma, mean, rstd, n, t, 1)
                grad_rows(dx, dy, x, gamma, stat, n, 1)

    @T.macro
    def reduce_column_block(out, part, which, cb):
        # out[c] = sum over tasks of part[t, which, c] for the columns c of block cb
        total = T.alloc_buffer((BLOCK,), acc, scope="local")
        for c0 in range(BLOCK // L):
            for v in T.vectorized(L):
                total[c0 * L + v] = zero()
        for t in range(used):
            for c0 in range(BLOCK // L):
                for v in T.vectorized(L):
                    total[c0 * L + v] = total[c0 * L + v] + part[t, which, cb * BLOCK + c0 * L + v]
        for c in range(T.min(BLOCK, C - cb * BLOCK)):
            out[cb * BLOCK + c] = total[c].astype(dtype)

    @T.macro
    def reduce_tasks(dgamma, dbeta, part):
        # the partials added across tasks, parallel over column blocks (dbeta: layer norm only)
        for cb in T.parallel(blocks):
            reduce_column_block(dgamma, part, 0, cb)
            if layer:
                reduce_column_block(dbeta, part, 1, cb)

    if layer:
        # fmt: off
        @T.prim_func
        def fuel_layer_norm_backward_cpu(dy_h: T.handle, x_h: T.handle, gamma_h: T.handle, mean_h: T.handle,
                                         rstd_h: T.handle, dx_h: T.handle, dgamma_h: T.handle, dbeta_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            dy = T.match_buffer(dy_h, (N, C), dtype)
            x = T.match_buffer(x_h, (N, C), dtype)
            gamma = T.match_buffer(gamma_h, (C,), dtype)
            mean = T.match_buffer(mean_h, (N,), acc)
            rstd = T.match_buffer(rstd_h, (N,), acc)
            dx = T.match_buffer(dx_h, (N, C), dtype)
            dgamma = T.match_buffer(dgamma_h, (C,), dtype)
            dbeta = T.match_buffer(dbeta_h, (C,), dtype)
            part = T.alloc_buffer((TASKS, 2, CP), acc)  # each task's dgamma, dbeta partials
            for t in T.parallel(TASKS):
                task_rows(dy, x, gamma, mean, rstd, dx, part, t)
            reduce_tasks(dgamma, dbeta, part)
        # fmt: on
        return finish(fuel_layer_norm_backward_cpu)

    # fmt: off
    @T.prim_func
    def fuel_rms_norm_backward_cpu(dy_h: T.handle, x_h: T.handle, weight_h: T.handle, rstd_h: T.handle,
                                   dx_h: T.handle, dweight_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        dy = T.match_buffer(dy_h, (N, C), dtype)
        x = T.match_buffer(x_h, (N, C), dtype)
        weight = T.match_buffer(weight_h, (C,), dtype)
        rstd = T.match_buffer(rstd_h, (N,), acc)
        dx = T.match_buffer(dx_h, (N, C), dtype)
        dweight = T.match_buffer(dweight_h, (C,), dtype)
        part = T.alloc_buffer((TASKS, 1, CP), acc)  # each task's dweight partials
        for t in T.parallel(TASKS):
            task_rows(dy, x, weight, None, rstd, dx, part, t)
        reduce_tasks(dweight, None, part)
    # fmt: on
    return finish(fuel_rms_norm_backward_cpu)
