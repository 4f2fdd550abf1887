"""Where a kernel's rows and keys live, as the task macros ask it: the dense layout (``DenseRows``)
and one sequence of FlashAttention's packed layout (``PackedSequence``). The backward's tasks and
the short-call rows kernels read and write through them, so one macro serves both.

Contents:
    DenseRows      -- q, do, out [B, Hq, Sq, D], k, v [B, Hkv, Sk, D], per-row statistics [B, Hq, Sq]
    PackedSequence -- sequence rows of q [total_q, Hq, D], k, v [total_k, Hkv, D], statistics [Hq, total_q]
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T


class _Lengths:
    """A layout's query and key counts of batch (sequence) b: its ``Sq`` and ``Sk``."""

    def q_len(self, b):
        return self.Sq

    def k_len(self, b):
        return self.Sk


@dataclass(frozen=True)
class DenseRows(_Lengths):
    """Where row i of query head h (key j of KV head g) of batch b lives in the dense layout: q, do,
    out [B, Hq, Sq, D], k, v, dk, dv [B, Hkv, Sk, D], per-row lse and D [B, Hq, Sq]. The packed
    varlen layout (``PackedSequence``) answers the same questions per sequence."""

    Sq: tirx.PrimExpr
    Sk: tirx.PrimExpr

    def query(self, buf, b, h, i, d):
        """q or do [.., D] element d of query (b, h, i)."""
        return buf[b, h, i, d]

    def key(self, buf, b, g, j, d):
        """k or v element d of key (b, g, j)."""
        return buf[b, g, j, d]

    def row(self, buf, b, h, i):
        """The per-row statistic (lse, D) of query (b, h, i)."""
        return buf[b, h, i]

    def store_key(self, buf, value, b, g, j, d):
        """dk or dv element d of key (b, g, j) := value (a statement where called in a macro)."""
        T.buffer_store(buf, value, [b, g, j, d])

    def store_query(self, buf, value, b, h, i, d):
        """dq or out element d of query (b, h, i) := value (a statement where called in a macro)."""
        T.buffer_store(buf, value, [b, h, i, d])

    def store_row(self, buf, value, b, h, i):
        """The per-row statistic (the forward's lse) of query (b, h, i) := value."""
        T.buffer_store(buf, value, [b, h, i])


@dataclass(frozen=True)
class PackedSequence(_Lengths):
    """One sequence of the packed layout: its queries are rows ``q_start ..`` of q, do, out
    [total_q, Hq, D] (and columns of lse, D [Hq, total_q]), its keys rows ``k_start ..`` of k, v,
    dk, dv [total_k, Hkv, D]; Sq, Sk its lengths. The batch index the macros pass is not read."""

    q_start: tirx.PrimExpr
    k_start: tirx.PrimExpr
    Sq: tirx.PrimExpr
    Sk: tirx.PrimExpr

    def query(self, buf, b, h, i, d):
        return buf[self.q_start + i, h, d]

    def key(self, buf, b, g, j, d):
        return buf[self.k_start + j, g, d]

    def row(self, buf, b, h, i):
        return buf[h, self.q_start + i]

    def store_key(self, buf, value, b, g, j, d):
        T.buffer_store(buf, value, [self.k_start + j, g, d])

    def store_query(self, buf, value, b, h, i, d):
        T.buffer_store(buf, value, [self.q_start + i, h, d])

    def store_row(self, buf, value, b, h, i):
        T.buffer_store(buf, value, [h, self.q_start + i])


__all__ = ["DenseRows", "PackedSequence"]
