"""CPU dense forward of decode-shaped calls: at most STREAMING_ROWS query rows per task (Sq times the
GQA group), keys and values read in place.

The paged decode's streaming task (``paged.PagedTile.attend_task``) over the dense layout
(``layouts.DenseKeys``): no key tile is packed, so no workspace exists and a call's time follows
its own Sq * Sk. The register-tiled kernel (``forward.dense_forward``) packs every KV head's keys
into whole tiles first; for many tiny rows (a batch of 2048 single-token sequences) that packing
wrote 64 keys per real one and cost 15-150x the floor's time.

Contents:
    dense_decode_forward -- PrimFunc(q, k, v, [alibi_slopes], [attn_mask], out, [lse]): dense_forward's,
                            its body the streaming tasks
"""

from __future__ import annotations

from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T

from ..common import KernelSpec
from ..layouts import DenseKeys
from .forward import dense_forward, ForwardMacros
from .paged import decode_tasks, PagedTile
from .tiles import STREAMING_ROWS, CpuTiles


def dense_decode_forward(spec: KernelSpec, tiles: CpuTiles, *,
                         dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """Flash attention forward over q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] with tasks of at most
    STREAMING_ROWS rows (``tiles.block_q``) of ``tiles.kv_heads`` KV heads each, streaming their
    keys; ``dims`` fixes B, Sq, Sk (symbolic where absent). Same parameters as ``dense_forward``."""
    if tiles.block_q > STREAMING_ROWS:
        raise ValueError(f"dense_decode_forward: block_q {tiles.block_q} streams at most {STREAMING_ROWS} rows; "
                         "more rows take dense_forward")
    paged = PagedTile(spec, tiles, ForwardMacros(spec, tiles))

    @T.macro
    def streamed_tasks(params, B, Sq, Sk, k, v):
        decode_tasks(paged, params, B, Sq, spec, lambda b: Sk, lambda b: DenseKeys(k, v, b))

    return dense_forward(spec, tiles, dims=dims, tasks=streamed_tasks)
