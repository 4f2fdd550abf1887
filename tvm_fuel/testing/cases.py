"""The benchmark's shapes and the work each one does (FlashAttention's FLOP count, K/V bytes read).

Shared by ``python -m tvm_fuel bench`` (CPU), the deploy bundle's bench and tune stages (CUDA),
the tuner's buckets and progress lines; no TVM needed.

Contents:
    attention_flops, kv_bytes -- the work of a case
    FlashCase, PagedCase      -- one benchmark shape (with a dtype)
    default_suite             -- the CPU benchmark's shapes
    head_dim_suite            -- forward rows at the head dims models use beyond 64 and 128
    tiny_rows_suite           -- many one- to sixteen-token sequences (B 2048), forward and backward
    cuda_suite                -- the CUDA benchmark's shapes (bf16, H200-sized)
    FLOOR_MAX_SCORES
"""

from __future__ import annotations

from dataclasses import dataclass

# The floor materializes about six [B, Hq, Sq, Sk] float32 buffers; beyond this many scores it is
# skipped (its backward alone takes over a minute at 8 x 2048 x 2048 on 2 cores).
FLOOR_MAX_SCORES = 8 * 1024 * 1024


def attention_flops(B: int, Hq: int, Sq: int, Sk: int, D: int, *, causal: bool, backward: bool) -> float:
    """FlashAttention's count: ``4 B Hq Sq Sk D``, halved when causal, 2.5x for the backward."""
    return 4.0 * B * Hq * Sq * Sk * D / (2 if causal else 1) * (2.5 if backward else 1.0)


def kv_bytes(B: int, context: int, Hkv: int, D: int, itemsize: int = 4) -> float:
    """Bytes of K and V a decode step reads: every live token's row of both caches."""
    return 2.0 * B * context * Hkv * D * itemsize


@dataclass(frozen=True)
class FlashCase:
    B: int
    H: int
    S: int
    D: int
    causal: bool
    backward: bool = False
    dtype: str = "float32"

    @property
    def name(self) -> str:
        return (f"flash_{'bwd' if self.backward else 'fwd'} B{self.B} H{self.H} S{self.S} D{self.D}"
                f"{' causal' if self.causal else ''}{'' if self.dtype == 'float32' else ' ' + self.dtype}")

    @property
    def flops(self) -> float:
        return attention_flops(self.B, self.H, self.S, self.S, self.D, causal=self.causal, backward=self.backward)


@dataclass(frozen=True)
class PagedCase:
    B: int
    Hq: int
    Hkv: int
    D: int
    block_size: int
    context: int
    capacity: int
    dtype: str = "float32"

    @property
    def name(self) -> str:
        return (f"paged_decode B{self.B} Hq{self.Hq} Hkv{self.Hkv} D{self.D} bs{self.block_size} "
                f"ctx{self.context}/{self.capacity}{'' if self.dtype == 'float32' else ' ' + self.dtype}")

    @property
    def bytes_read(self) -> float:
        return kv_bytes(self.B, self.context, self.Hkv, self.D, itemsize=4 if self.dtype == "float32" else 2)

    @property
    def flops(self) -> float:
        return 4.0 * self.B * self.Hq * self.context * self.D


def default_suite() -> tuple[list[FlashCase], list[PagedCase]]:
    """The CPU benchmark's shapes (float32; paged decode also over a bfloat16 cache)."""
    flash = [FlashCase(1, 8, s, d, c, bwd) for bwd in (False, True) for (s, d) in ((1024, 64), (2048, 128))
             for c in (False, True)]
    paged = [PagedCase(8, 32, 8, 128, 16, 4096, 4096), PagedCase(8, 32, 8, 128, 16, 1024, 4096),
             PagedCase(8, 32, 8, 128, 16, 4096, 4096, dtype="bfloat16")]
    return flash, paged


def head_dim_suite() -> list[FlashCase]:
    """Forward at S 2048 over head dims 80, 96, 112, 160, 192 and 256 (Phi, Mixtral-era models,
    Gemma): not tuning buckets, so their rows run the rules' hand-picked knobs."""
    return [FlashCase(1, 8, 2048, d, causal) for d in (80, 96, 112, 160, 192, 256) for causal in (False, True)]


def tiny_rows_suite() -> list[FlashCase]:
    """B 2048 x H 8 sequences of S 1, 4 and 16 tokens (D 64, causal), forward and backward: a batch of
    decode-shaped rows, where the cost must follow the rows, not whole tiles (timed against the floor)."""
    return [FlashCase(2048, 8, s, 64, True, backward) for backward in (False, True) for s in (1, 4, 16)]


def cuda_suite() -> tuple[list[FlashCase], list[PagedCase]]:
    """bf16 flash forward/backward at 4k tokens (causal and not), paged decode B64 at 4k and 1k."""
    flash = [FlashCase(4, 16, 4096, 128, causal, backward, dtype="bfloat16")
             for backward in (False, True) for causal in (False, True)]
    return flash, [PagedCase(64, 32, 8, 128, 16, context, 4096, dtype="bfloat16") for context in (4096, 1024)]
