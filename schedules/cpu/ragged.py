"""The ragged-batch machinery the CPU kernels over packed sequences share: TVM's KV-cache slots
(``tvm_cache``) and FlashAttention's packed variable-length forward (``varlen``). Sequence b owns
rows ``q_start(b) ..`` of q [total_q, Hq, D] and its keys come from a layout (``schedules.layouts``:
TVM's pages, or rows of k, v [total_kv, Hkv, D]), both read through a ``tvm_params.TvmArgs``.

A task is one (sequence, KV head, row tile): its rows pack (query position, head of the group) as
fuel's dense forward packs them, a sequence's whole key tiles are packed once per (sequence, KV
head) into flat workspaces of at most total keys * D floats per KV head (a sequence's last, partial
tile is packed by each task that sees it, into its own scratch: one-token sequences would
otherwise cost a whole tile each), and run through the dense forward's online-softmax macros
(``ForwardMacros``), so the cost follows each sequence's own Sq * Sk.

The lse conventions (``LSE_LOG2``, ``LSE_NATURAL``): TVM's log2 units, lse [total_q, Hq] and -5e4
for a row without keys (``layouts.EMPTY_LSE``); FlashAttention's natural log, lse [Hq, total_q] and
-inf. Either way such a row's output is 0.

Contents:
    RaggedTask     -- the macros of one task: queries loaded (rotated where asked), key tiles packed,
                      the rows attended over the packed tiles, output and lse stored
    task_scratch   -- a task's scratch buffers (and a packed K and V tile)
    PackedKeys     -- the packed key tiles of every (sequence, KV head), as views
    prefill_phases -- the macro of a ragged prefill: pack every sequence's keys, then run the tasks
    find_sequence  -- the sequence of a unit (row tile, task) from prefix sums, by binary search
    dealt_tasks    -- a ragged batch's tasks dealt to parallel workers in turn (each finds its sequence)
    LSE_LOG2, LSE_NATURAL
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import semantics as sem
from ..common import F32, KernelSpec, row_position
from ..layouts import EMPTY_LSE
from .common import named_buffer
from .forward import ForwardMacros, RowTile, Scratch
from .paged import PagedTile
from .tiles import CpuTiles, STREAMING_ROWS

LSE_LOG2 = "log2"  # TVM's: lse[row, head] = m + log2(sum), EMPTY_LSE without keys
LSE_NATURAL = "natural"  # FlashAttention's: lse[head, row] in natural log, -inf without keys
LSE_RULES = (LSE_LOG2, LSE_NATURAL, None)  # None: the kernel has no lse


def default_rope_freq(s: tirx.PrimExpr, d: tirx.PrimExpr, d_range: int, theta, dtype: str):
    """RoPE's cosine and sine at position ``s`` for element ``d`` of ``d_range`` (TVM's
    ``rope_freq_default`` of ``relax.frontend.nn.llm.position_embedding``, expression for expression:
    the frequency bound to a variable), and that binding."""
    freq = s / tirx.power(theta, d * 2 % d_range / tirx.const(d_range, "float32"))
    freq_var = tirx.Var("freq", "float32")
    return tirx.cos(freq_var).astype(dtype), tirx.sin(freq_var).astype(dtype), {freq_var: freq}


def _rope(load, d, position, head_dim: int, rope_scale, rope_theta, dtype: str, rope_freq: Callable):
    """Element d of a row rotated at ``position`` (TVM's ``_rope`` over the whole head dim):
    ``load(i)`` reads element i of the row."""
    cos_freq, sin_freq, bindings = rope_freq(position * rope_scale, d, head_dim, rope_theta, "float32")
    half = head_dim // 2
    partner = tirx.if_then_else(d < half, -load(d + half), load(d - half))
    value = (cos_freq * load(d).astype(F32) + sin_freq * partner.astype(F32)).astype(dtype)
    for var, bound in bindings.items():
        value = tirx.Let(var, bound, value)
    return value


class RaggedTask:
    """The macros of one (sequence, KV head, row tile) task over a ragged batch, for one attention
    config (``spec.cfg``): queries loaded (rotated where asked) and scaled by ``sm_scale`` (scores
    then in log2 units, as ``ForwardMacros`` takes them), key tiles packed (``packed_tile``,
    rotated where asked) or streamed (``paged``), the output and the lse stored (``lse``: one of
    ``LSE_RULES``). Rows pack (query position, head of the group) as fuel's forward kernels do.

    ``queries_after_keys``: the rows are the tokens after all of the keys (TVM's sliding-window
    prefill over cached keys only), not its last tokens. ``rotary_mode`` is a run-time value or a
    Python int (0: the rotation is not built)."""

    def __init__(self, spec: KernelSpec, tiles: CpuTiles, rope_freq: Callable | None = None, *,
                 queries_after_keys: bool = False, lse: str | None = LSE_LOG2):
        if lse not in LSE_RULES:
            raise ValueError(f"RaggedTask: lse must be one of {LSE_RULES}, got {lse!r}")
        rope_freq, lse_rule = rope_freq or default_rope_freq, lse
        D, group, dtype, cfg = spec.head_dim, spec.group, spec.dtype, spec.cfg
        BQ, BK, MR = tiles.block_q, tiles.block_k, tiles.micro_rows
        body = ForwardMacros(spec, tiles)
        paged = PagedTile(spec, tiles, body)
        self.body, self.paged = body, paged
        log2e = T.float32(sem.LOG2E)

        def rotated(load, d, position, rope_scale, rope_theta):
            return _rope(load, d, position, D, rope_scale, rope_theta, dtype, rope_freq).astype(F32)

        @T.macro
        def load_queries(Qs, q, q_row, q_position, tile, rotary_mode, rope_scale, rope_theta, sm_scale):
            # row r: query head tile.row_head(r) of token q_row(position), rotated at q_position(position);
            # rows past the last real one are 0 up to the GEMMs' live rows (RowTile.live_rows)
            for r in range(tile.live_rows(BQ, MR)):
                if tile.r0 + r >= tile.head_rows:
                    for d in range(D):
                        Qs[r, d] = T.float32(0)
            for r in range(BQ):
                if tile.r0 + r < tile.head_rows:
                    for d in range(D):
                        if rotary_mode == 1:
                            Qs[r, d] = rotated(lambda i: q[q_row(tile.row_position(r)), tile.row_head(r), i], d,
                                               q_position(tile.row_position(r)), rope_scale, rope_theta)
                        else:
                            Qs[r, d] = q[q_row(tile.row_position(r)), tile.row_head(r), d].astype(F32)
                        Qs[r, d] = Qs[r, d] * sm_scale * log2e

        @T.macro
        def pack_tile(Kt, Vt, nonfinite, cache, g, kv_len, kt, rotary_mode, rope_scale, rope_theta, keys=BK):
            # the paged kernels' packing (PagedTile.pack_tile) of the tile's first `keys`, then the keys
            # rotated in place where rotary_mode is 1: key j at cache.rope_position(j), rounded to the
            # cache dtype as TVM rounds
            paged.pack_tile(Kt, Vt, nonfinite, cache, g, kv_len, kt, keys)
            if rotary_mode == 1:
                row = T.alloc_buffer((D,), F32, scope="local")
                for c in range(keys):
                    j: T.int64 = kt * BK + c  # (bound first: LLVM codegen fails on the loop vars in RoPE's Lets)
                    if j < kv_len:
                        for d in range(D):
                            row[d] = Kt[d, c]
                        for d in range(D):
                            Kt[d, c] = rotated(lambda i: row[i], d, cache.rope_position(j), rope_scale, rope_theta)

        @T.macro
        def packed_tile(scratch, Kt, Vt, params, cache, tile, kt, rotary_mode, rope_scale, rope_theta):
            # key tile kt packed (the keys its rows see: a short sequence's tile is not packed whole),
            # then both GEMMs over it
            nonfinite = T.alloc_buffer((1,), F32, scope="local")
            pack_tile(Kt, Vt, nonfinite, cache, tile.g, tile.kv_len, kt, rotary_mode, rope_scale, rope_theta,
                      tile.width(cfg, kt * BK, BK, tiles.key_vecs * tiles.lanes))
            body.attend_tile(scratch, Kt, Vt, params, tile, kt * BK, nonfinite[0] == T.float32(0))

        @T.macro
        def store(scratch, output, lse_out, q_row, tile):
            for r in range(BQ):
                if tile.r0 + r < tile.head_rows:
                    for d in range(D):
                        output[q_row(tile.row_position(r)), tile.row_head(r), d] = sem.normalize(
                            scratch.O[r, d], scratch.l[r]).astype(dtype)
                    if lse_rule == LSE_LOG2:
                        lse_out[q_row(tile.row_position(r)), tile.row_head(r)] = T.Select(
                            scratch.l[r] == T.float32(0), T.float32(EMPTY_LSE),
                            sem.safe_row_max(scratch.m[r]) + T.log2(scratch.l[r]))
                    elif lse_rule == LSE_NATURAL:
                        lse_out[tile.row_head(r), q_row(tile.row_position(r))] = sem.log_sum_exp(
                            sem.safe_row_max(scratch.m[r]) * T.float32(sem.LN2), scratch.l[r])

        @T.macro
        def attend_packed(own, scratch, Kt, Vt, params, packed, keys, tile, kt, rotary_mode, rope_scale, rope_theta):
            # a whole key tile was packed beforehand (``packed.tile(kt)``: Kt, Vt and Vt's non-finite
            # count); the sequence's last, partial one is packed by the task into its own Kt, Vt.
            # packed None (streaming tasks, at most STREAMING_ROWS rows): the tile's K and V rows are
            # read in place, or packed by the task where its keys are rotated (``own``: the scratch whose
            # view is ``scratch``)
            if packed is None:
                if rotary_mode == 1:
                    packed_tile(scratch, Kt, Vt, params, keys, tile, kt, rotary_mode, rope_scale, rope_theta)
                else:
                    paged.stream_tile(own, params, keys, tile, kt)
            elif kt < tile.kv_len // BK:
                Kp, Vp, nonfinite = T.meta_var(packed.tile(kt))
                body.attend_tile(scratch, Kp, Vp, params, tile, kt * BK, nonfinite[0] == T.float32(0))
            else:
                packed_tile(scratch, Kt, Vt, params, keys, tile, kt, rotary_mode, rope_scale, rope_theta)

        @T.macro
        def attend_rows(q, output, lse_out, params, packed, keys, b, g, t, kv_len, qo_len, q_start, q_rope_position,
                        rotary_mode, rope_scale, rope_theta, sm_scale, own_scratch=None):
            # row tile t of (sequence b, KV head g): its rows' queries against the sequence's key
            # tiles (``attend_packed``; ``keys``: the sequence's layout, for its partial tile), in
            # ``own_scratch`` (``task_scratch``; None: allocated here)
            rows: T.int64 = qo_len * group
            if t * BQ < rows:
                own, Kt, Vt = T.meta_var(own_scratch if own_scratch is not None else task_scratch(tiles, D))
                scratch = T.meta_var(own.view(0))
                tile = T.meta_var(RowTile(group, b, g, t * BQ, rows, kv_len=kv_len,
                                          delta=kv_len if queries_after_keys else kv_len - qo_len,
                                          first_pos=row_position(t * BQ, group),
                                          last_pos=row_position(T.min(t * BQ + BQ, rows) - 1, group)))
                load_queries(scratch.Qs, q, lambda position: q_start + position,
                             lambda position: q_rope_position[q_start + position], tile, rotary_mode, rope_scale,
                             rope_theta, sm_scale)
                body.init_state(scratch.O, scratch.m, scratch.l, tile.live_rows(BQ, MR))
                if cfg.sink_tokens > 0:  # the sink tokens' tiles left of the window, then the window's
                    walk = T.meta_var(tile.key_walk(cfg, BK))
                    for step in range(walk.count):
                        kt: T.int64 = walk.tile(step)
                        attend_packed(own, scratch, Kt, Vt, params, packed, keys, tile, kt, rotary_mode,
                                      rope_scale, rope_theta)
                else:
                    lo, hi = T.meta_var(tile.key_tiles(cfg, BK))
                    for kt in range(lo, hi):
                        attend_packed(own, scratch, Kt, Vt, params, packed, keys, tile, kt, rotary_mode,
                                      rope_scale, rope_theta)
                store(scratch, output, lse_out, lambda position: q_start + position, tile)

        self.load_queries, self.pack_tile, self.packed_tile, self.store = load_queries, pack_tile, packed_tile, store
        self.attend_rows = attend_rows


def task_scratch(tiles: CpuTiles, D: int):
    """A task's buffers, allocated where it is called in a prim_func: the [1, ...] scratch
    (``PagedTile`` indexes per head) and a packed K and V tile."""
    BQ, BK, DP = tiles.block_q, tiles.block_k, tiles.padded_dim(D)
    scratch = Scratch(named_buffer("Qs", (1, BQ, D)), named_buffer("S", (1, BQ, BK)), named_buffer("O", (1, BQ, DP)),
                      named_buffer("m", (1, BQ)), named_buffer("l", (1, BQ)), named_buffer("alpha", (1, BQ)))
    return scratch, named_buffer("Kt", (D, BK)), named_buffer("Vt", (BK, DP))


@dataclass(frozen=True)
class PackedKeys:
    """Every (key tile, KV head) of a prefill's sequences, packed once into flat workspaces: sequence
    b's key tile kt of head g at index ``(first_tile + kt) * Hkv + g`` (``first_tile``: the key
    tiles of the sequences before b). ``tile(kt)`` gives its Kt [D, BK], Vt [BK, DP] and Vt's
    non-finite count [1] as views."""

    k_tiles: tirx.Buffer
    v_tiles: tirx.Buffer
    nonfinite: tirx.Buffer
    first_tile: tirx.PrimExpr
    g: tirx.PrimExpr
    num_kv_heads: int
    dims: tuple[int, int, int]  # D, BK, DP

    def tile(self, kt):
        D, BK, DP = self.dims
        index = (self.first_tile + kt) * self.num_kv_heads + self.g
        return (T.decl_buffer((D, BK), F32, data=self.k_tiles.data, elem_offset=index * (D * BK)),
                T.decl_buffer((BK, DP), F32, data=self.v_tiles.data, elem_offset=index * (BK * DP)),
                T.decl_buffer((1,), F32, data=self.nonfinite.data, elem_offset=index))


@T.macro
def find_sequence(bounds, first, B, index):
    # bounds[0] := the sequence b whose units (row tiles, tasks) hold unit ``index``: the last
    # b < B with first[b] <= index (an empty sequence shares its successor's start); log2(B) steps.
    # bounds: a local buffer of 2 (any integer dtype B fits in)
    bounds[0] = T.Cast(bounds.dtype, 0)
    bounds[1] = T.Cast(bounds.dtype, B)
    while bounds[1] - bounds[0] > 1:
        if first[(bounds[0] + bounds[1]) // 2] <= index:
            bounds[0] = (bounds[0] + bounds[1]) // 2
        else:
            bounds[1] = (bounds[0] + bounds[1]) // 2


def _bit_reversed(worker, workers: int):
    # the slot of worker w: w's bits reversed (workers a power of two), so that consecutive tasks go
    # to workers far apart, i.e. to different threads of the parallel loop's contiguous chunks
    bits = workers.bit_length() - 1
    return sum(((worker >> k) & 1) << (bits - 1 - k) for k in range(bits))


def _worker_slot(worker, workers: int, spread: bool):
    if not spread:
        return sem.as_int64(worker)
    if workers & (workers - 1):
        raise ValueError(f"dealt_tasks: spread needs a power-of-two count of workers, got {workers}")
    return sem.as_int64(_bit_reversed(worker, workers))


@T.macro
def dealt_tasks(workers, n_tasks, first, B, stride, task_body, context, spread=False, scratch_of=None):
    # n_tasks tasks dealt to ``workers`` parallel workers in turn: the worker of slot s runs tasks
    # s, s + workers, ... (slot: the worker itself, or with ``spread`` its bits reversed, so that
    # even a few tasks of unlike cost land on every thread). Task t belongs to sequence b, the last
    # with first[b] <= t // stride (``first``: prefix sums over B sequences of units of ``stride``
    # tasks); it runs as task_body(context, t, b), or with ``scratch_of`` as task_body(context, t,
    # b, scratch), the worker's scratch allocated once for all its tasks (TVM 0.27 makes a buffer of
    # 1 KiB or more a workspace call: per task, thousands of one-token sequences paid for them)
    for worker in T.parallel(workers):
        slot: T.int64 = _worker_slot(worker, workers, spread)
        bounds = T.alloc_buffer((2,), "int32", scope="local")  # a sequence index (int32: MLC-LLM's narrowing)
        scratch = T.meta_var(scratch_of() if scratch_of is not None else None)
        for step in range(T.max(n_tasks - slot + workers - 1, T.int64(0)) // workers):
            task_id: T.int64 = slot + step * workers
            find_sequence(bounds, first, B, task_id // stride)
            if scratch_of is None:
                task_body(context, task_id, T.Cast("int64", bounds[0]))
            else:
                task_body(context, task_id, T.Cast("int64", bounds[0]), scratch)


def _tvm_key_tiles(a, BK: int):
    # the whole key tiles of all sequences: at most the pages' (k's rows') slots over BK
    return (T.Cast("int64", a.nnz_pages) * a.page_size if a.pages is not None
            else T.Cast("int64", a.total_kv)) // BK


def prefill_phases(spec: KernelSpec, tiles: CpuTiles, plain: RaggedTask, causal_task: RaggedTask | None, *,
                   where: str = "tvm_cache.prefill", key_tiles: Callable | None = None, workers: int = 0,
                   stream: bool = False):
    """The macro of every ragged prefill, ``run(a, params, causal, rotary_mode, rope_scale,
    rope_theta, sm_scale)`` (``a``: the kernel's ``TvmArgs``; ``params``: its ``ForwardBuffers``):
    key tiles packed once per (sequence, KV head), then the (sequence, KV head, row tile) tasks
    over them (``causal_task`` where the run-time ``causal`` is non-zero; None: ``plain`` always).

    ``key_tiles(a, block_k)``: a bound on the key tiles of all sequences from the parameters'
    shapes alone, never negative whatever their values (the workspaces are allocated with the
    function, before any statement runs); by default TVM's, each sequence's keys filling its pages
    (its rows of k) but the last. ``where`` names the kernel in the message of the check that the
    sequences' tiles fit it.

    ``workers`` (0: off): the tasks are the sequences' real row tiles only, dealt to ``workers``
    parallel workers in turn (worker w runs tasks w, w + workers, ...), so sequences of very
    different lengths spread over every thread (a parallel loop hands each thread a contiguous
    chunk: over (sequence, KV head, the most row tiles) a thread may get the long sequences and
    another the empty tasks of the short ones). Each task finds its sequence by a binary search
    over the row tiles' prefix sums.

    ``stream`` (tiles of at most STREAMING_ROWS rows, one KV head a task): nothing is packed; each
    task reads its key tiles' K and V rows in place (``PagedTile.stream_tile``), so a batch of
    many short sequences costs its own keys, not a packed tile each (no workspace at all)."""
    if stream and (tiles.block_q > STREAMING_ROWS or tiles.kv_heads != 1):
        raise ValueError(f"prefill_phases: streaming tasks take at most {STREAMING_ROWS} rows of one KV head, "
                         f"got block_q {tiles.block_q}, kv_heads {tiles.kv_heads}")
    Hkv, D, group = spec.num_kv_heads, spec.head_dim, spec.group
    BQ, BK, DP = tiles.block_q, tiles.block_k, tiles.padded_dim(D)
    overflow = f"{where}: the sequences' keys exceed their pages (indptr)"
    bound = key_tiles or _tvm_key_tiles

    @T.macro
    def attend_task(a, params, causal, rotary_mode, rope_scale, rope_theta, sm_scale, k_tiles, v_tiles, nonfinite,
                    first_tile, b, g, t, own_scratch=None):
        # row tile t of (sequence b, KV head g) over the sequence's packed key tiles. The sequence and
        # its key count are bound once: written out in every bound and index, TVM's passes spent
        # seconds on a sliding window's page arithmetic (docs/test-time.md)
        seq: T.int64 = b
        kv_len: T.int64 = a.kv_len(seq)
        packed = T.meta_var(None if stream else PackedKeys(k_tiles, v_tiles, nonfinite, first_tile[seq], g, Hkv,
                                                           (D, BK, DP)))
        args = T.meta_var((a.q, a.output, a.lse, params, packed, a.keys(seq), seq, g, t, kv_len, a.q_len(seq),
                           a.q_start(seq), a.q_rope_position, rotary_mode, rope_scale, rope_theta, sm_scale,
                           own_scratch))
        if causal_task is None:
            plain.attend_rows(*args)
        elif causal > 0:
            causal_task.attend_rows(*args)
        else:
            plain.attend_rows(*args)

    @T.macro
    def row_task(context, task_id, b, own_scratch):
        # dealt task ``task_id`` of sequence b: KV head task_id % Hkv of its row tile task_id // Hkv
        first_row_tile = T.meta_var(context[-1])
        attend_task(*context[:-1], b, task_id % Hkv, task_id // Hkv - first_row_tile[b], own_scratch)

    def workspaces(max_tiles):
        # every sequence's whole key tiles per KV head: K^T, V and V's non-finite count
        return (named_buffer("k_tiles", (max_tiles * Hkv * D * BK,), F32),
                named_buffer("v_tiles", (max_tiles * Hkv * BK * DP,), F32),
                named_buffer("nonfinite", (max_tiles * Hkv,), F32))

    @T.macro
    def run(a, params, causal, rotary_mode, rope_scale, rope_theta, sm_scale):
        # a (TvmArgs): the kernel's parameters
        B = T.meta_var(a.B)
        max_tiles = T.meta_var(bound(a, BK))
        # counts: first key tile of each sequence (and the total), the most row tiles of a sequence;
        # int32 tiles (TVM's cache counts its tokens in int32, and MLC-LLM's pipeline narrows every
        # kernel's indices to int32, refusing an int64 buffer)
        first_tile = T.alloc_buffer((B + 1,), "int32")
        first_row_tile = T.alloc_buffer((B + 1,), "int32")
        most_rows = T.alloc_buffer((1,), "int32")
        first_tile[0] = 0
        first_row_tile[0] = 0
        most_rows[0] = 0
        for b in range(B):
            # whole tiles: the last is the tasks'
            first_tile[b + 1] = first_tile[b] + T.Cast("int32", a.kv_len(b) // BK)
            first_row_tile[b + 1] = first_row_tile[b] + T.Cast("int32", (a.q_len(b) * group + BQ - 1) // BQ)
            most_rows[0] = T.max(most_rows[0], T.Cast("int32", (a.q_len(b) * group + BQ - 1) // BQ))
        assert T.Cast("int64", first_tile[B]) <= max_tiles, overflow
        n_row_tiles: T.int64 = T.Cast("int64", most_rows[0])
        k_tiles, v_tiles, nonfinite = T.meta_var((None, None, None) if stream else workspaces(max_tiles))
        if not stream:
            for pack in T.parallel(T.Cast("int64", B) * Hkv):
                pb: T.int64 = pack // Hkv
                pg: T.int64 = pack % Hkv
                pack_kv_len: T.int64 = a.kv_len(pb)
                tiles_of = T.meta_var(PackedKeys(k_tiles, v_tiles, nonfinite, first_tile[pb], pg, Hkv, (D, BK, DP)))
                for kt in range(first_tile[pb + 1] - first_tile[pb]):
                    Kt, Vt, count = T.meta_var(tiles_of.tile(kt))
                    plain.pack_tile(Kt, Vt, count, a.keys(pb), pg, pack_kv_len, kt, rotary_mode, rope_scale,
                                    rope_theta)
        if workers > 0:
            context = T.meta_var((a, params, causal, rotary_mode, rope_scale, rope_theta, sm_scale, k_tiles, v_tiles,
                                  nonfinite, first_tile, first_row_tile))
            dealt_tasks(workers, first_row_tile[B] * Hkv, first_row_tile, B, Hkv, row_task, context,
                        scratch_of=lambda: task_scratch(tiles, D))
        else:
            for task_id in T.parallel(T.Cast("int64", B) * Hkv * n_row_tiles):
                attend_task(a, params, causal, rotary_mode, rope_scale, rope_theta, sm_scale, k_tiles, v_tiles,
                            nonfinite, first_tile, task_id // (Hkv * n_row_tiles), task_id // n_row_tiles % Hkv,
                            task_id % n_row_tiles)

    return run


__all__ = ["RaggedTask", "task_scratch", "PackedKeys", "prefill_phases", "find_sequence", "dealt_tasks", "LSE_LOG2",
           "LSE_NATURAL", "LSE_RULES"]
