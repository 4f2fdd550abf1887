"""What a performance-path kernel is built for: the spec of the call and its runtime dims.

A ``Workload`` names one kernel instance independently of the kernel's code: the op, the static
facts of the call (``KernelSpec``), the gradients it produces and its runtime dims (ints, or
None where the call's dim is symbolic). Its ``key`` (canonical JSON) is what tuning logs record,
so a log keeps matching when a kernel template changes, and ``Workload.from_key`` rebuilds it in
the processes that build candidates.

Contents:
    KernelSpec -- the static facts of one kernel instance (dtype, heads, head dim, options, ...)
    NormSpec   -- those of a norm backward kernel (dtype, feature count C)
    Workload   -- op + spec + grads + dims; key / from_key / matches / in_bucket_of / describe
    size_bucket -- the bucket ladder of a runtime dim (powers of two)
    KEY_VERSION

Shape buckets: a record tuned at static dims also serves calls whose every dim falls in the same
bucket of the ladder ``size_bucket``: powers of two, a size ``n`` belonging to the smallest
``2**k >= n`` (1, 2, 3-4, 5-8, ..., 513-1024, ...; 0 is its own bucket). A record tuned at
Sq = Sk = 1024 serves a call at 1000; one at 1000 serves 1024 too. An exact record wins over a
bucket neighbour.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from tvm_fuel.op.config import AttnConfig

KEY_VERSION = 1  # bump when the meaning of a knob changes: older records then stop matching


@dataclass(frozen=True)
class KernelSpec:
    """What one kernel is specialised on (B, Sq, Sk and the cache size are runtime dims)."""

    dtype: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    cfg: AttnConfig
    has_alibi: bool = False
    mask_dtype: str | None = None  # "bool" (keep) or a float dtype (additive)
    mask_broadcast: tuple[bool, ...] = ()  # per mask dim (right-aligned to B, Hq, Sq, Sk): size 1
    return_lse: bool = False
    block_size: int = 0  # paged only
    has_sinks: bool = False  # paged only (sinks folded into each row's sum; no lse output)
    table_dtype: str = "int32"
    lens_dtype: str = "int32"
    cache_dtype: str = ""  # paged only: an 8-bit cache's dtype ("": the caches are dtype)
    kv_scale: str = ""  # paged only: the 8-bit cache's scales, "" (none), "tensor" [], "head" [Hkv] or "token"

    def __post_init__(self):
        if self.has_sinks and (not self.block_size or self.return_lse):
            # the kernels fold sinks into the paged kernels' row sums only; an lse would miss them
            raise ValueError("KernelSpec: has_sinks is a paged kernel's (block_size > 0) without return_lse")
        if (self.cache_dtype or self.kv_scale) and not self.block_size:
            raise ValueError("KernelSpec: cache_dtype and kv_scale are a paged kernel's (block_size > 0)")
        if (self.kv_scale == "token") != (self.cache_dtype == "int8") or (self.kv_scale and not self.cache_dtype):
            raise ValueError(f"KernelSpec: kv_scale {self.kv_scale!r} does not scale a "
                             f"{self.cache_dtype or self.dtype} cache (int8: 'token'; fp8: '', 'tensor' or 'head')")

    @property
    def kv_dtype(self) -> str:
        """The dtype of the K and V tensors the kernel reads (a cache's, where it is 8-bit)."""
        return self.cache_dtype or self.dtype

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.cfg.scale_for(self.head_dim)

    @property
    def elementwise_logits(self) -> bool:
        """Whether every score needs a transform (else only boundary tiles are masked)."""
        return self.cfg.softcap > 0 or self.has_alibi or self.mask_dtype is not None


@dataclass(frozen=True)
class NormSpec:
    """What a norm backward kernel is specialised on (the row count N is a runtime dim)."""

    dtype: str
    features: int  # C

    def describe_parts(self) -> list[str]:
        return [self.dtype, f"C{self.features}"]


@dataclass(frozen=True)
class Workload:
    """One kernel instance: ``dims`` maps each runtime dim name to its size (None: symbolic).

    Dense ops have dims (B, Sq, Sk); paged attention (B, Sq, num_blocks, max_blocks).
    """

    op: str
    spec: KernelSpec | NormSpec
    dims: tuple[tuple[str, int | None], ...]
    grads: tuple[str, ...] = ()

    @property
    def is_static(self) -> bool:
        return all(size is not None for _, size in self.dims)

    @property
    def dim(self) -> dict[str, int | None]:
        return dict(self.dims)

    @property
    def key(self) -> str:
        """Canonical JSON of the workload (what a tuning record is matched on)."""
        spec = asdict(self.spec)
        # the keys of the records written before sinks and sink tokens existed stay as they were
        for name in ("has_sinks", "cache_dtype", "kv_scale"):
            if name in spec and not spec[name]:
                del spec[name]
        if "cfg" in spec and not spec["cfg"]["sink_tokens"]:
            del spec["cfg"]["sink_tokens"]
        body = {"v": KEY_VERSION, "op": self.op, "spec": spec, "dims": [list(d) for d in self.dims],
                "grads": list(self.grads)}
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_key(key: str) -> Workload:
        """The workload a ``key`` describes; ValueError if it is not one of this version."""
        try:
            body = json.loads(key)
            if body.get("v") != KEY_VERSION:
                raise ValueError(f"key version {body.get('v')!r}, expected {KEY_VERSION}")
            spec = dict(body["spec"])
            cfg = dict(spec.pop("cfg"))
            spec = KernelSpec(cfg=AttnConfig(cfg["softmax_scale"], bool(cfg["causal"]), tuple(cfg["window_size"]),
                                             float(cfg["softcap"]), int(cfg.get("sink_tokens", 0))),
                              mask_broadcast=tuple(spec.pop("mask_broadcast")), **spec)
            return Workload(body["op"], spec, tuple((str(n), s) for n, s in body["dims"]), tuple(body["grads"]))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as err:
            raise ValueError(f"not a tvm_fuel workload key: {err}") from err

    def matches(self, tuned: Workload) -> bool:
        """Whether knobs tuned for the static ``tuned`` serve this workload: same op, spec and
        grads, and equal dims wherever this workload's dim is static."""
        if (self.op, self.spec, self.grads) != (tuned.op, tuned.spec, tuned.grads):
            return False
        theirs = tuned.dim
        return all(size is None or theirs.get(name) == size for name, size in self.dims)

    def in_bucket_of(self, tuned: Workload) -> bool:
        """Whether ``tuned`` (static) shares this workload's op, spec and grads, and each of this
        workload's static dims lies in the same ``size_bucket`` as the tuned size."""
        if (self.op, self.spec, self.grads) != (tuned.op, tuned.spec, tuned.grads):
            return False
        theirs = tuned.dim
        return all(size is None or (theirs.get(name) is not None and size_bucket(theirs[name]) == size_bucket(size))
                   for name, size in self.dims)

    def distance(self, tuned: Workload) -> float:
        """How far ``tuned``'s dims are from this workload's static ones (sum of |log2 ratio|; 0: equal)."""
        theirs = tuned.dim
        return sum(abs(math.log2(max(1, theirs[name]) / max(1, size))) for name, size in self.dims
                   if size is not None and theirs.get(name) is not None)

    def dims_label(self) -> str:
        """The dims alone, e.g. ``B1 Sq1024 Sk1024`` (``?`` for a symbolic one)."""
        return " ".join(f"{name}{'?' if size is None else size}" for name, size in self.dims)

    def describe(self) -> str:
        """A short human-readable label, e.g. ``flash_attn_backward float32 Hq8/Hkv8 D64 causal B1 Sq1024 Sk1024``."""
        if isinstance(self.spec, NormSpec):
            return " ".join([self.op, *self.spec.describe_parts(), self.dims_label()])
        spec, cfg = self.spec, self.spec.cfg
        parts = [self.op, spec.dtype, f"Hq{spec.num_q_heads}/Hkv{spec.num_kv_heads}", f"D{spec.head_dim}"]
        if spec.block_size:
            parts.append(f"bs{spec.block_size}")
        if cfg.causal:
            parts.append("causal")
        if cfg.window_size != (-1, -1):
            parts.append(f"window{list(cfg.window_size)}")
        if cfg.sink_tokens:
            parts.append(f"sink_tokens{cfg.sink_tokens}")
        if cfg.softcap:
            parts.append(f"softcap{cfg.softcap:g}")
        if spec.has_alibi:
            parts.append("alibi")
        if spec.mask_dtype:
            parts.append(f"mask:{spec.mask_dtype}")
        if spec.has_sinks:
            parts.append("sinks")
        if spec.cache_dtype:
            parts.append(f"cache:{spec.cache_dtype}" + (f"/{spec.kv_scale}" if spec.kv_scale else ""))
        return " ".join([*parts, self.dims_label()])


def size_bucket(n: int) -> int:
    """The bucket of a runtime dim of size ``n``: the smallest power of two ``>= n`` (0 for 0)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()
