"""Warp-level register tiles on tensor cores: ``ldmatrix``, ``mma.sync.m16n8k16`` and the
row reductions of an online softmax, with a lane-faithful emulation.

A warp multiplies 16x16 by 16x8 tiles held in its 32 lanes' registers (float16/bfloat16 in,
float32 accumulators): the products never pass through shared memory, so a kernel rescales
and exponentiates its accumulators where they are (FlashAttention-2's structure). Which lane
holds which element is fixed by the PTX ISA (``mma.m16n8k16``, lane = 4 * group + quad):

    A 16x16, row-major, 8 elements:  row group + 8 * (i // 2 % 2), column 2 * quad + i % 2 + 8 * (i // 4)
    B 16x8 (k x n), col-major, 4:    k 2 * quad + i % 2 + 8 * (i // 2), column group
    C 16x8, float32, 4:              row group + 8 * (i // 2), column 2 * quad + i % 2

So the C fragments of two adjacent 8-column tiles are, element for element, the A fragment
of the 16x16 tile they form (P = softmax(S) feeds P V with no shuffle), and the 4 lanes of a
group hold one row (its reductions are two xor-shuffles).

Emulation (``Launch.emulate``): a fragment buffer holds every lane's registers, one row per
(warp, lane) slot; ``ldmatrix`` and ``mma`` become loops that place and combine elements by
the layouts above, and a shuffle reads the partner lane's slot. Per-lane code runs in a loop
over the lanes. The kernels' index arithmetic (which lane holds which score, key and row) is
thus what the CPU tests check; ``ldmatrix``'s per-lane addresses are checked against the same
layouts by ``fragment_from_ldmatrix``.

Contents:
    a_element, b_element, c_element -- (row, column) of fragment element i of a lane
    a_owner, b_owner                -- (lane, element) holding a given A / B entry
    ldmatrix_row                    -- the shared-memory row and column each lane addresses
    fragment_from_ldmatrix          -- what ldmatrix hands a lane, by the ISA's rule (for tests)
    WarpTiles                       -- the macros, for one launch, dtype and warp count
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .device import F32, WARP, Launch

PTX_TYPE = {"float16": "fp16", "bfloat16": "bf16"}
C_REGS = 4  # float32 elements per lane of a 16x8 C (accumulator) tile
QUAD_STEPS = (1, 2)  # xor distances that combine the 4 lanes of a row group


def a_element(lane, i):
    """(row, column) of element ``i`` (0..7) of a lane's 16x16 A fragment."""
    return lane // 4 + 8 * (i // 2 % 2), 2 * (lane % 4) + i % 2 + 8 * (i // 4)


def b_element(lane, i):
    """(k, n) of element ``i`` (0..3) of a lane's 16x8 B fragment."""
    return 2 * (lane % 4) + i % 2 + 8 * (i // 2), lane // 4


def c_element(lane, i):
    """(row, column) of element ``i`` (0..3) of a lane's 16x8 C (accumulator) fragment."""
    return lane // 4 + 8 * (i // 2), 2 * (lane % 4) + i % 2


def a_owner(row, col):
    """(lane, element) whose A fragment holds entry (row, col) of the 16x16 tile."""
    return 4 * (row % 8) + col % 8 // 2, col % 2 + 2 * (row // 8) + 4 * (col // 8)


def b_owner(k, n):
    """(lane, element) whose B fragment holds entry (k, n) of the 16x8 tile."""
    return 4 * n + k % 8 // 2, k % 2 + 2 * (k // 8)


def ldmatrix_row(lane, operand: str):
    """(row, column) offsets in the shared tile of the 8-element row ``lane`` addresses in a
    four-matrix ``ldmatrix``. ``operand``: "a" (16x16 A, rows are A's rows), "b" (two 16x8 B
    tiles stored n-major, rows are n: K of Q K^T), "b_trans" (two B tiles stored k-major, rows
    are k, loaded with ``.trans``: V of P V)."""
    if operand == "a":
        return lane % 16, lane // 16 * 8
    if operand == "b":
        return lane // 16 * 8 + lane % 8, lane // 8 % 2 * 8
    if operand == "b_trans":
        return lane % 16, lane // 16 * 8
    raise ValueError(f"ldmatrix_row: operand must be 'a', 'b' or 'b_trans', got {operand!r}")


def fragment_from_ldmatrix(tile, operand: str) -> list[list]:
    """What ``ldmatrix.x4`` (``.trans`` for "b_trans") leaves in each lane's 8 halves when lane l
    addresses ``ldmatrix_row(l, operand)`` of ``tile`` (a 2-D list): the ISA's rule, matrix j's
    rows come from lanes 8j..8j+7 and lane l receives its row l // 4, columns 2 (l % 4) + {0, 1}
    (of the transposed matrix with ``.trans``) in register j."""
    rows = [ldmatrix_row(lane, operand) for lane in range(WARP)]
    fragments = []
    for lane in range(WARP):
        halves = []
        for j in range(4):
            for h in range(2):
                if operand == "b_trans":  # element (2 (l % 4) + h, l // 4) of matrix j
                    r, c = rows[8 * j + 2 * (lane % 4) + h]
                    halves.append(tile[r][c + lane // 4])
                else:
                    r, c = rows[8 * j + lane // 4]
                    halves.append(tile[r][c + 2 * (lane % 4) + h])
        fragments.append(halves)
    return fragments


class WarpTiles:
    """Register tiles of ``warps`` warps for one launch and input dtype.

    Fragment buffers are ``[slots, n]`` in the launch's local scope: one slot on the device
    (this thread's registers), one per (warp, lane) in the emulation. Per-lane code reads
    ``buf[slot(w, lane), i]`` inside ``for li in lanes(): lane = lane_of(li, tx)``.
    """

    def __init__(self, launch: Launch, dtype: str, warps: int):
        if dtype not in PTX_TYPE:
            raise ValueError(f"WarpTiles: tensor-core tiles take float16 or bfloat16, got {dtype}")
        self.launch, self.dtype, self.warps = launch, dtype, warps
        emulate = launch.emulate
        self.slots = warps * WARP if emulate else 1
        ab = PTX_TYPE[dtype]

        def slot(w, lane):
            return w * WARP + lane if emulate else 0

        self.slot = slot

        def load(operand: str):
            transposed = operand == "b_trans"

            def element(lane, i):  # (row, column) in the shared tile of fragment element i
                if operand == "a":
                    return a_element(lane, i)
                k, n = b_element(lane, i % 4)  # two 16x8 B tiles: elements 0-3 and 4-7
                n = n + 8 * (i // 4)
                return (k, n) if transposed else (n, k)

            @T.macro
            def ldmatrix(frag, off, smem, row0, col0, w, tx):
                # 16x16 of smem from (row0, col0) into 8 halves of each lane's fragment, from ``off``
                if emulate:
                    for lane in T.serial(WARP):
                        for i in T.serial(8):
                            frag[slot(w, lane), off + i] = smem[row0 + element(lane, i)[0], col0 + element(lane, i)[1]]
                else:
                    T.evaluate(T.ptx_legacy.ldmatrix(
                        transposed, 4, ".b16", frag.data, off, smem.access_ptr("r"),
                        (row0 + ldmatrix_row(tx % WARP, operand)[0]) * smem.shape[1] + col0
                        + ldmatrix_row(tx % WARP, operand)[1], dtype=dtype))

            return ldmatrix

        self.load_a, self.load_b, self.load_b_trans = load("a"), load("b"), load("b_trans")

        def a_at(a, w, a_off, row, k):
            return a[slot(w, a_owner(row, k)[0]), a_off + a_owner(row, k)[1]].astype(F32)

        def b_at(b, w, b_off, k, n):
            return b[slot(w, b_owner(k, n)[0]), b_off + b_owner(k, n)[1]].astype(F32)

        @T.macro
        def mma(d, d_off, a, a_off, b, b_off, w):
            # d[.., d_off:d_off+4] += A (a[.., a_off:a_off+8]) @ B (b[.., b_off:b_off+4]), the warp's 16x8 tile
            if emulate:
                for lane in T.serial(WARP):
                    for i in T.serial(C_REGS):
                        for k in T.serial(16):
                            d[slot(w, lane), d_off + i] = d[slot(w, lane), d_off + i] + a_at(
                                a, w, a_off, c_element(lane, i)[0], k) * b_at(b, w, b_off, k, c_element(lane, i)[1])
            else:
                T.evaluate(T.ptx_legacy.mma("m16n8k16", "row", "col", ab, ab, "fp32", a.data, a_off, b.data, b_off,
                                            d.data, d_off, False, dtype=F32))

        self.mma = mma

        def reduce(combine):
            @T.macro
            def quad_reduce(buf, n, w, tx):
                # buf[.., 0:n] of every lane becomes the combination over the 4 lanes of its row group
                if emulate:
                    partner = T.alloc_buffer((WARP, n), F32, scope="global")
                    for step in T.serial(len(QUAD_STEPS)):
                        for lane in T.serial(WARP):
                            for j in T.serial(n):
                                partner[lane, j] = buf[slot(w, T.bitwise_xor(lane, T.shift_left(1, step))), j]
                        for lane in T.serial(WARP):
                            for j in T.serial(n):
                                buf[slot(w, lane), j] = combine(buf[slot(w, lane), j], partner[lane, j])
                else:
                    for step in T.unroll(len(QUAD_STEPS)):
                        for j in T.unroll(n):
                            buf[0, j] = combine(buf[0, j], T.tvm_warp_shuffle_xor(
                                T.uint32(0xFFFFFFFF), buf[0, j], T.shift_left(1, step), WARP, WARP))

            return quad_reduce

        self.quad_max = reduce(lambda x, y: T.max(x, y))
        self.quad_sum = reduce(lambda x, y: x + y)

        @T.macro
        def fill(buf, n, value, tx):
            # buf[.., 0:n] = value in every lane of every warp this thread runs
            for wi in self.warp_loop():
                for li in self.lanes():
                    for e in launch.owned(n):
                        buf[slot(self.warp_of(wi, tx), self.lane_of(li, tx)), e] = value

        self.fill = fill

    def nonfinite_terms(self, strips: int, inner: int, columns: int, head_dim: int):
        """Macro ``nonfinite_terms(acc, weights, value, valid, w, tx)``: for the C fragments
        ``acc[strips x columns]`` += ``weights[strips x inner]`` @ X, the terms of X's NaN and Inf
        elements that ``zero_nonfinite`` had zeroed: ``acc[r, d] += weights[r, i] * X[i, d]``
        where X[i, d] (``value(w, i, d)``, re-read from global memory; ``valid(w, i)``: row i
        exists) is not finite and the weight is not 0. Each lane holds rows of ``weights`` and
        ``acc`` alike; the weight of inner index i is in lane (i % 8) // 2 of the lane's group
        (one shuffle per i). Meant for flagged tiles only: it re-reads the whole tile."""
        launch = self.launch
        own = launch.owned
        DT = columns // 8

        def weight_of(weights, mt, row_half, i, w, lane):
            # weights[row, i] of the lane's row (strip mt, row_half; not `half`, a CUDA type): C element
            # row_half * 2 + i % 2 of n-tile i // 8 in lane (i % 8) // 2 of the lane's group. On the
            # device the register is picked by a chain of selects with static indices (a dynamic one
            # would put the fragment in local memory), then shuffled over from that lane.
            src = lane // 4 * 4 + i % 8 // 2
            if launch.emulate:
                return weights[self.slot(w, src), (mt * inner // 8 + i // 8) * 4 + row_half * 2 + i % 2]
            picked = T.float32(0)
            for nt in range(inner // 8):
                for e2 in range(2):
                    picked = T.Select(tirx.all(i // 8 == nt, i % 2 == e2),
                                      weights[self.slot(w, lane), (mt * inner // 8 + nt) * 4 + row_half * 2 + e2],
                                      picked)
            return T.tvm_warp_shuffle(T.uint32(0xFFFFFFFF), picked, src, WARP, WARP)

        def column(li, tx, dt, e):  # acc column of C element row_half * 2 + e of the lane's n-tile dt
            return dt * 8 + 2 * (self.lane_of(li, tx) % 4) + e

        def acc_at(mt, dt, row_half, e):
            return (mt * DT + dt) * 4 + row_half * 2 + e

        @T.macro
        def nonfinite_terms(acc, weights, value, valid, w, tx):
            for li in self.lanes():
                for mt in own(strips):
                    for row_half in own(2):
                        for i in T.serial(inner):
                            weight: T.float32 = weight_of(weights, mt, row_half, i, w, self.lane_of(li, tx))
                            for dt in own(DT):
                                for e in own(2):
                                    if tirx.all(valid(w, i), column(li, tx, dt, e) < head_dim, weight != T.float32(0)):
                                        x: T.float32 = T.Cast(F32, value(w, i, column(li, tx, dt, e)))
                                        if not T.isfinite(x):
                                            acc[self.slot(w, self.lane_of(li, tx)), acc_at(mt, dt, row_half, e)] = (
                                                acc[self.slot(w, self.lane_of(li, tx)), acc_at(mt, dt, row_half, e)]
                                                + weight * x)

        return nonfinite_terms

    def warp_loop(self):
        """The warps this thread runs: all of them, one after the other, in the emulation."""
        return T.serial(self.warps if self.launch.emulate else 1)

    def warp_of(self, wi, tx):
        return wi if self.launch.emulate else tx // WARP

    def lanes(self):
        """The lanes this thread runs: every lane of the warp in the emulation, its own on the device."""
        return T.serial(WARP if self.launch.emulate else 1)

    def lane_of(self, li, tx):
        return li if self.launch.emulate else tx % WARP


__all__ = ["WarpTiles", "a_element", "b_element", "c_element", "a_owner", "b_owner", "ldmatrix_row",
           "fragment_from_ldmatrix", "C_REGS"]
