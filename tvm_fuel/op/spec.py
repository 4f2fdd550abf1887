"""What every fuel op is: its registered name, its arguments and its attributes.

Optional tensor arguments are kept in the call's argument list only when given; a ``has_<name>``
attribute records which are present, so a printed call parses back unambiguously.

Contents:
    OpSpec     -- one op's identity (name, required and optional arguments), call building and splitting
    SPECS      -- op name -> OpSpec, for every fuel op
    options_of -- a call's attention options as constructor keyword arguments
    attn_attrs -- constructor options -> validated call attributes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tvm import relax
from tvm.ir import Op

from .config import AttnConfig


@dataclass(frozen=True)
class OpSpec:
    """A fuel op's identity: its registered name, its argument names, and its extra attributes."""

    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    attention: bool = True  # carries the AttnConfig attributes

    @property
    def op_name(self) -> str:
        return f"relax.fuel.{self.name}"

    @property
    def grads(self) -> tuple[str, ...]:
        """The gradients a backward op returns: (dq, dk, dv), or the one its name ends with."""
        if not self.name.startswith("flash_attn_backward"):
            return ()
        suffix = self.name[len("flash_attn_backward"):]
        return ("dq", "dk", "dv") if not suffix else ("d" + suffix[1:],)

    @property
    def label(self) -> str:
        """How errors name the op."""
        return f"fuel.{self.name}"

    def split_args(self, call: relax.Call) -> dict[str, Any]:
        """Map argument names to the call's arguments (None for an absent optional one)."""
        present = [opt for opt in self.optional if bool(call.attrs[f"has_{opt}"])]
        names = list(self.required) + present
        if len(call.args) != len(names):
            raise ValueError(f"{self.label}: expected the arguments {names}, got {len(call.args)} arguments")
        found = dict(zip(names, call.args))
        return {name: found.get(name) for name in self.required + self.optional}

    def make_call(self, args: Mapping[str, Any], attrs: Mapping[str, Any]) -> relax.Call:
        """Build the call from named arguments (optional ones may be None) and attributes."""
        for name in self.required:
            if args.get(name) is None:
                raise ValueError(f"{self.label}: argument {name!r} is required")
        call_args = [args[name] for name in self.required]
        all_attrs = dict(attrs)
        for name in self.optional:
            all_attrs[f"has_{name}"] = args.get(name) is not None
            if args.get(name) is not None:
                call_args.append(args[name])
        for i, arg in enumerate(call_args):
            if not isinstance(arg, relax.Expr):
                name = (list(self.required) + [o for o in self.optional if args.get(o) is not None])[i]
                raise TypeError(f"{self.label}: argument {name!r} must be a Relax expression, got {type(arg).__name__}")
        return relax.Call(Op.get(self.op_name), call_args, attrs=all_attrs)

    def replace(self, call: relax.Call, args: Mapping[str, Any] | None = None, **attrs) -> relax.Call:
        """``call`` rebuilt with some arguments (None drops an optional one) or attributes changed;
        every other argument and attribute kept, whatever the op's arguments are."""
        kept = {**self.split_args(call), **(args or {})}
        old = {key: call.attrs[key] for key in call.attrs.keys() if not key.startswith("has_")}
        return self.make_call(kept, {**old, **attrs})


# ``sinks`` comes last: the kernels never take it (``schedules`` rescales their out and lse), so
# the order of the arguments they do take is unchanged
_BWD_ARGS = dict(required=("q", "k", "v", "do"), optional=("alibi_slopes", "attn_mask", "out", "lse", "sinks"))

SPECS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec("flash_attn", ("q", "k", "v"), ("alibi_slopes", "attn_mask", "sinks")),
        OpSpec("flash_attn_backward", **_BWD_ARGS),
        OpSpec("flash_attn_backward_q", **_BWD_ARGS),
        OpSpec("flash_attn_backward_k", **_BWD_ARGS),
        OpSpec("flash_attn_backward_v", **_BWD_ARGS),
        OpSpec("paged_attn", ("q", "k_cache", "v_cache", "block_table", "context_lens"),
               ("alibi_slopes", "sinks", "k_scale", "v_scale")),
        # FlashAttention's packed variable-length layout (q [total_q, Hq, D], cu_seqlens [B + 1])
        OpSpec("flash_attn_varlen", ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), ("alibi_slopes", "sinks")),
        OpSpec("flash_attn_varlen_backward", ("q", "k", "v", "do", "cu_seqlens_q", "cu_seqlens_k"),
               ("alibi_slopes", "out", "lse", "sinks")),
        OpSpec("softmax_backward", ("probs", "dprobs"), attention=False),
        # kernels take the present arguments in exactly this order, then the outputs
        OpSpec("flash_attn_jvp", ("q", "k", "v"), ("q_dot", "k_dot", "v_dot", "alibi_slopes", "attn_mask")),
        OpSpec("flash_attn_double_backward", ("q", "k", "v", "do"),
               ("dq_bar", "dk_bar", "dv_bar", "alibi_slopes", "attn_mask", "out", "lse")),
        OpSpec("layer_norm_backward", ("dy", "x", "gamma", "mean", "rstd"), attention=False),
        OpSpec("rms_norm_backward", ("dy", "x", "weight", "rstd"), attention=False),
    )
}


def options_of(call: relax.Call) -> dict[str, Any]:
    """The attention options of a fuel call (``softmax_scale``, ``causal``, ``window_size``,
    ``softcap``) as constructor keyword arguments: the one path from attributes to options."""
    spec = SPECS[call.op.name[len("relax.fuel."):]]
    return AttnConfig.from_attrs(spec.label, call.attrs).options()


def attn_attrs(op: str, **options) -> dict[str, Any]:
    """A constructor's options validated (``AttnConfig``) and written as call attributes."""
    return AttnConfig.create(f"fuel.{op}", **options).to_attrs()
