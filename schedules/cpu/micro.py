"""TensorIR building blocks shared by the CPU kernels (TVMScript macros over one task's tiles).

All buffers here are per-task scratch: a score tile S [block_q, block_k], an accumulator
[block_q, padded_dim], and row statistics [block_q], float32 (int16 / int32 for the integer
decode's rounded rows and sums). Nothing here grows with the sequence.

The per-row scratch of the softmax and the int16 rounding is in the default scope, its shift a
``T.let``: TVM 0.27 makes a ``local`` buffer or a mutable scalar a ``TVMBackendAllocWorkspace``
call, here one per row and key tile (side by side: dense forward hdim 64 0.89x, hdim 256 0.90x
of the time). count_nonfinite's lanes stay ``local`` (in the default scope the backward took 1.15x
as long), and so does the gemm's register tile (no difference either way).

Contents:
    lane_tree     -- a balanced tree over the scalar lanes of a small buffer
    store_row_sums -- the lane sums of several vector rows as one transposing shuffle tree
    add_term      -- acc + weight * value, optionally skipping zero weights (the NaN rule)
    adds_anything -- whether a weight's term counts (not 0; NaN counts): the rows kernels' branches
    INT16_DOT_LANES, INT16_DOT_SUMS, int16_dot -- int32 lane sums of int16 pair products (x86 AVX2's vpmaddwd)
    round_rows_to_int16 -- float32 rows as int16 times a unit per row (what int16_dot multiplies)
    RowOps        -- a row's dot product with a key row, and a weighted row added (one row at a time)
    Micro         -- the macros of one tile configuration:
        gemm            C (+)= A @ B on register tiles (A optionally read transposed, C optionally
                        rescaled per row as it is loaded)
        nan_safe_gemm   gemm that skips zero weights unless a run-time flag says the values are finite
        scale_rows      C[r, :] *= factor[r]
        count_nonfinite whether a tile holds a NaN or Inf (picks the gemm that skips 0 weights)
        online_softmax  the FlashAttention-2 row update of (m, l) and S -> 2^(S - m) (log2 units)
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import semantics as sem
from .tiles import CpuTiles


def _add(a, b):
    return a + b


def lane_tree(combine, part, lanes: int):
    """``part[0] ∘ part[1] ∘ ... ∘ part[lanes - 1]`` as a balanced tree: log2(lanes) dependent steps
    where a running fold would take ``lanes`` (the row max and sum end every softmax row)."""
    values = [part[v] for v in range(lanes)]
    while len(values) > 1:
        values = [combine(*values[i:i + 2]) if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
    return values[0]


def store_row_sums(out, buffer, rows: int, lanes: int):
    """``out[r] = sum(buffer[r, 0:lanes])`` for r < rows (``out`` holds rows rounded up to a power of
    two), emitted as statements where it is called in a macro: vectors of partial rows folded
    pairwise by shuffles: [a0 a1 | b0 b1] -> [a0+a1, b0+b1]. A dot product per key along the head
    dim ends in such a horizontal sum; per row it costs log2(lanes) dependent shuffles, and LLVM
    scalarizes half-width slices of a local buffer through general registers (~25 instructions a
    row). Transposing rows into one vector shares the shuffles: ~2 a row.
    """
    if lanes == 1:
        for r in range(rows):
            T.buffer_store(out, tirx.BufferLoad(buffer, [r, 0]), [r])
        return
    ramp = tirx.Ramp(0, 1, lanes)
    vectors = [tirx.BufferLoad(buffer, [r, ramp]) for r in range(rows)]
    while len(vectors) & (len(vectors) - 1):
        vectors.append(tirx.Broadcast(tirx.const(0, buffer.dtype), lanes))
    groups, width = 1, lanes  # each vector holds `groups` rows of `width` partial lanes
    while len(vectors) > 1 and width > 1:
        half = width // 2
        low = [g * width + j for g in range(2 * groups) for j in range(half)]
        vectors = [_shuffle(a, b, low) + _shuffle(a, b, [i + half for i in low])
                   for a, b in zip(vectors[0::2], vectors[1::2])]
        groups, width = 2 * groups, half
    while width > 1:  # fewer rows than lanes: halve within each row
        half = width // 2
        low = [g * width + j for g in range(groups) for j in range(half)]
        vectors = [_shuffle(v, None, low) + _shuffle(v, None, [i + half for i in low]) for v in vectors]
        width = half
    for k, vector in enumerate(vectors):
        T.buffer_store(out, vector, [tirx.Ramp(k * groups, 1, groups) if groups > 1 else k])


def _shuffle(a, b, indices):
    # lanes of a then b (TIR's Shuffle concatenates its vectors); a single lane is a scalar
    return tirx.Shuffle([a] if b is None else [a, b], [tirx.const(i, "int32") for i in indices])


def add_term(acc, weight, value, skip_zero_weights: bool):
    """``acc + weight * value``; with ``skip_zero_weights`` the term of a weight of exactly 0 is
    skipped (``sem.add_weighted``), for values that may hold NaN or Inf at dropped keys or rows."""
    return sem.add_weighted(acc, weight, value) if skip_zero_weights else acc + weight * value


def adds_anything(weight):
    """Whether a float32 weight's term counts under the NaN rule: not exactly 0 (a NaN weight counts;
    TIR's ``!=`` on floats is an ordered compare, false for NaN, so alone it would drop NaNs)."""
    return tirx.Or(weight != T.float32(0), tirx.isnan(weight))


INT16_DOT_LANES = 16  # int16 elements one vpmaddwd multiplies
INT16_DOT_SUMS = INT16_DOT_LANES // 2  # the int32 lanes it sums them into, pairwise


def int16_dot(acc, row, a, b):
    """``acc[row, 0:8] += pmaddwd(a, b)`` emitted as a statement (``acc`` an int32 [rows, 8]
    buffer, ``a`` and ``b`` int16x16 vectors): lane i gains a[2i] b[2i] + a[2i+1] b[2i+1] in one
    instruction, twice the multiplies of a float32 FMA and no conversion to float. x86 AVX2 only
    (``CpuTiles.int16_dot``); exact while the sums fit int32."""
    lanes = [row, tirx.Ramp(0, 1, INT16_DOT_SUMS)]
    product = tirx.call_llvm_pure_intrin(f"int32x{INT16_DOT_SUMS}", "llvm.x86.avx2.pmadd.wd", a, b)
    T.buffer_store(acc, tirx.BufferLoad(acc, lanes) + product, lanes)


ROUND_LANES = 8  # float32 lanes of round_rows_to_int16's passes (rows of whole vectors)


@T.macro
def round_rows_to_int16(x, x16, unit, heads, rows, dim):
    # x16[h, r] * unit[h, r] ~ x[h, r] (float32 [heads, rows, dim], dim a multiple of 8), the unit
    # max|x[h, r]| / 32767; a row holding Inf or NaN gets a NaN unit, so what it feeds is NaN as in
    # float (a max drops NaN), and int16 zeros (a NaN cast to int16 is undefined). Vectorized: a
    # key tile's weights are rounded so per tile
    for h, r in T.grid(heads, rows):
        part_max = T.alloc_buffer((ROUND_LANES,), "float32")  # lane max |x|
        part_sum = T.alloc_buffer((ROUND_LANES,), "float32")  # lane sum x
        stats = T.alloc_buffer((3,), "float32")  # max |x|, sum x, 1 / unit
        for v in T.vectorized(ROUND_LANES):
            part_max[v] = T.float32(0)
            part_sum[v] = T.float32(0)
        for d0 in range(dim // ROUND_LANES):
            for v in T.vectorized(ROUND_LANES):
                part_max[v] = T.max(part_max[v], T.abs(x[h, r, d0 * ROUND_LANES + v]))
                part_sum[v] = part_sum[v] + x[h, r, d0 * ROUND_LANES + v]
        stats[0] = lane_tree(T.max, part_max, ROUND_LANES)
        stats[1] = lane_tree(_add, part_sum, ROUND_LANES)
        # an Inf shows in the max, a NaN in the sum (an add keeps NaN; finite rows' sums are NaN only
        # past float32's range in both signs)
        bad = T.meta_var(T.Or(T.isnan(stats[1]), T.Not(T.isfinite(stats[0]))))
        nonzero = T.meta_var(stats[0] > T.float32(0))
        unit[h, r] = T.Select(bad, T.float32("nan"), T.Select(nonzero, stats[0] * T.float32(1.0 / 32767), T.float32(1)))
        stats[2] = T.Select(nonzero, T.float32(32767) / stats[0], T.float32(1))
        for d0 in range(dim // ROUND_LANES):
            for v in T.vectorized(ROUND_LANES):
                x16[h, r, d0 * ROUND_LANES + v] = T.Cast("int16", T.round(
                    T.Select(bad, T.float32(0), x[h, r, d0 * ROUND_LANES + v] * stats[2])))


class RowOps:
    """The macros of one query row at a time against keys read in place (the short-sequence kernels,
    ``decode.dense_rows_forward``, ``backward_rows``), over a head dim of ``head_dim`` taken
    ``lanes`` (the widest of the target's lanes, 8, 4, 2, 1 that divides it) at a time:

    dot(total, lanes_buf, row, key_row)  total[0] = row . key_row(d) (lanes_buf [1, lanes]: the
                                          lane sums, folded by ``store_row_sums``)
    add_row(acc, r, weight, row)          acc[r, d] += weight * row(d)
    """

    def __init__(self, head_dim: int, lanes: int):
        D = head_dim
        LD = next(n for n in (lanes, 8, 4, 2, 1) if D % n == 0)
        self.lanes = LD

        @T.macro
        def dot(total, lanes_buf, row, key_row):
            for v in T.vectorized(LD):
                lanes_buf[0, v] = T.float32(0)
            for d0 in range(D // LD):
                for v in T.vectorized(LD):
                    lanes_buf[0, v] = lanes_buf[0, v] + row[d0 * LD + v] * key_row(d0 * LD + v)
            store_row_sums(total, lanes_buf, 1, LD)

        @T.macro
        def add_row(acc, r, weight, row):
            for d0 in range(D // LD):
                for v in T.vectorized(LD):
                    acc[r, d0 * LD + v] = acc[r, d0 * LD + v] + weight * row(d0 * LD + v)

        self.dot, self.add_row = dot, add_row


def _element(X, row, col, transposed: bool):
    # X[row, col] of a matrix that may be stored transposed
    return X[col, row] if transposed else X[row, col]


class Micro:
    """Macros specialised to one ``CpuTiles``; used inside the kernels' ``@T.prim_func`` bodies."""

    def __init__(self, tiles: CpuTiles):
        MR, L = tiles.micro_rows, tiles.lanes

        @T.macro
        def gemm(C, A, Bm, M: T.int32, N: T.int32, K, vecs: T.int32, a_transposed=False, accumulate=False,
                 row_scale=None, skip_zero_weights=False):
            # C[m, n] (+)= sum_k A[m, k] * Bm[k, n]; register tile MR x (vecs * L), n vectorized.
            # a_transposed: A is stored [K, M] (the GEMMs that reduce over a tile's rows).
            # row_scale (accumulating; None or a [M] buffer): C[m, :] * row_scale[m] + A @ B, the
            # online softmax's rescale of the accumulator applied as it is loaded (no pass of its own).
            # skip_zero_weights: see add_term. Requires M % MR == 0 and N % (vecs * L) == 0.
            for m0, n0 in T.grid(M // MR, N // (vecs * L)):
                acc = T.alloc_buffer((MR, vecs * L), "float32", scope="local")
                for mi in T.unroll(MR):
                    for nj in T.unroll(vecs):
                        for v in T.vectorized(L):
                            if accumulate:
                                if row_scale is None:
                                    acc[mi, nj * L + v] = C[m0 * MR + mi, n0 * (vecs * L) + nj * L + v]
                                else:
                                    acc[mi, nj * L + v] = (C[m0 * MR + mi, n0 * (vecs * L) + nj * L + v]
                                                           * row_scale[m0 * MR + mi])
                            else:
                                acc[mi, nj * L + v] = T.float32(0)
                for k in range(K):
                    for mi in T.unroll(MR):
                        for nj in T.unroll(vecs):
                            for v in T.vectorized(L):
                                acc[mi, nj * L + v] = add_term(
                                    acc[mi, nj * L + v], _element(A, m0 * MR + mi, k, a_transposed),
                                    Bm[k, n0 * (vecs * L) + nj * L + v], skip_zero_weights)
                for mi in T.unroll(MR):
                    for nj in T.unroll(vecs):
                        for v in T.vectorized(L):
                            C[m0 * MR + mi, n0 * (vecs * L) + nj * L + v] = acc[mi, nj * L + v]

        @T.macro
        def nan_safe_gemm(C, A, Bm, M: T.int32, N: T.int32, K, vecs: T.int32, values_finite,
                          a_transposed=False, accumulate=False, row_scale=None):
            # gemm over values Bm that may hold NaN or Inf where A's weight is 0: values_finite (a
            # run-time flag, from count_nonfinite) picks the plain gemm, else the one that skips
            # zero weights (0 * NaN is NaN)
            if values_finite:
                gemm(C, A, Bm, M, N, K, vecs, a_transposed, accumulate, row_scale)
            else:
                gemm(C, A, Bm, M, N, K, vecs, a_transposed, accumulate, row_scale, skip_zero_weights=True)

        @T.macro
        def scale_rows(C, factor, M: T.int32, N: T.int32):
            for r, c0 in T.grid(M, N // L):
                for v in T.vectorized(L):
                    C[r, c0 * L + v] = C[r, c0 * L + v] * factor[r]

        @T.macro
        def online_softmax(S, m, l, alpha, M: T.int32, N: T.int32):
            # S, m in log2 units (the queries carry log2 e in their scale), so exponentials are exp2:
            # per row: m' = max(m, max S); alpha = 2^(m - m'); S = 2^(S - m'); l = l * alpha + sum S.
            # The shift of a row that has seen no key yet (m' = -inf) is 0, so nothing becomes NaN.
            for r in range(M):
                part_max = T.alloc_buffer((L,), "float32")
                part_sum = T.alloc_buffer((L,), "float32")
                row = T.alloc_buffer((2,), "float32")
                for v in T.vectorized(L):
                    part_max[v] = m[r]
                    part_sum[v] = T.float32(0)
                for c0 in range(N // L):
                    for v in T.vectorized(L):
                        part_max[v] = T.max(part_max[v], S[r, c0 * L + v])
                row[0] = lane_tree(T.max, part_max, L)
                shift: T.let[T.float32] = sem.safe_row_max(row[0])
                alpha[r] = sem.fast_exp2(m[r] - shift)
                for c0 in range(N // L):
                    for v in T.vectorized(L):
                        S[r, c0 * L + v] = sem.fast_exp2(S[r, c0 * L + v] - shift)
                        part_sum[v] = part_sum[v] + S[r, c0 * L + v]
                row[1] = lane_tree(_add, part_sum, L)
                l[r] = l[r] * alpha[r] + row[1]
                m[r] = row[0]

        @T.macro
        def count_nonfinite(count, X, rows, cols: T.int32):
            # count[0] = how many elements of X[0:rows, 0:cols] are NaN or +-Inf (cols % L == 0): a
            # compare and an add per vector of X, next to the O(tile * rows) GEMMs the flag selects
            part = T.alloc_buffer((L,), "float32", scope="local")
            for v in T.vectorized(L):
                part[v] = T.float32(0)
            for r, c0 in T.grid(rows, cols // L):
                for v in T.vectorized(L):
                    part[v] = part[v] + T.Select(T.isfinite(X[r, c0 * L + v]), T.float32(0), T.float32(1))
            count[0] = lane_tree(_add, part, L)

        self.gemm = gemm
        self.nan_safe_gemm = nan_safe_gemm
        self.count_nonfinite = count_nonfinite
        self.scale_rows = scale_rows
        self.online_softmax = online_softmax
