"""The fuel kernels as MetaSchedule design spaces.

A fuel kernel is a TensorIR template instantiated from knobs (tile sizes, vector width, splits),
not a loop nest that schedule primitives rewrite. Its tuning workload is therefore a descriptor:
a PrimFunc with the static kernel's parameters whose body is one block ``fuel_kernel`` whose
annotations name the workload (``fuel.workload``: the ``Workload`` key) and its knob candidates
(``fuel.space``). A schedule samples each knob with ``sample_categorical`` and records the value
as the block annotation ``fuel.<knob>``; the trace is what the database stores. The builder
(``measure.build_candidate``) instantiates the kernel those annotations describe. Keeping the
kernel's TIR out of the workload keeps logs small and their hash independent of the template.

MetaSchedule's stock mutators and per-store features only understand loop transformations, so
the space brings its own: ``KnobMutator`` re-samples one knob of a trace (evolutionary search),
``KnobFeatures`` gives the xgboost cost model the knobs and what follows from them, and
``ValidKnobs`` drops a sampled combination the kernel cannot build before it is measured.

Contents:
    workload_module  -- IRModule of a workload's tuning task
    design_space     -- the ScheduleFn: one sample_categorical per knob
    knobs_of         -- (Workload, knobs) read back from a scheduled module (from tvm_fuel.dispatch.records)
    space_generator  -- ScheduleFn with the mutator and postproc above
    KnobMutator, ValidKnobs, KnobFeatures
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import tvm
from tvm import s_tir, tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..schedules import rule_for
from ..schedules.cpu.tiles import cores
from ..dispatch.records import BLOCK, KNOB_PREFIX, SPACE_KEY, VERIFIED_KEY, WORKLOAD_KEY, knobs_of
from ..schedules.workload import Workload

# the features the cost model sees, in this order (absent knobs count as 1)
FEATURE_KNOBS = ("lanes", "block_q", "block_k", "micro_rows", "key_vecs", "dim_vecs", "kv_heads", "splits",
                 "value_tokens", "prefetch")


def workload_module(workload: Workload, target: tvm.target.Target) -> tvm.IRModule:
    """The tuning task of a static ``workload``: the kernel's parameters and block ``fuel_kernel``."""
    if not workload.is_static:
        raise ValueError(f"tvm_fuel.tune: a tuning workload needs static dims, got {workload.describe()}")
    rule = rule_for(workload.op, target)
    if rule is None:
        raise ValueError(f"tvm_fuel.tune: no {target.kind.name} kernel serves {workload.op}")
    defaults = rule.default_knobs(workload, target)
    func = rule.kernel(workload, defaults, static=True)
    # the hand-picked knobs are always one point of the space
    space = {name: sorted({*values, defaults[name]}) for name, values in rule.knob_space(workload, target).items()}
    annotations = {WORKLOAD_KEY: workload.key, SPACE_KEY: json.dumps(space, sort_keys=True)}
    block = s_tir.SBlock([], [], [], BLOCK, tirx.Evaluate(0), annotations=annotations)
    root = s_tir.SBlock([], [], [], "root", s_tir.SBlockRealize([], True, block))
    func = tirx.PrimFunc(func.params, s_tir.SBlockRealize([], True, root), func.ret_type, func.attrs)
    # the task is tuned, not hand-scheduled: MetaSchedule skips functions marked scheduled
    return tvm.IRModule({"main": func.without_attr("tirx.is_scheduled")})


def fixed_point(mod: tvm.IRModule, knobs: dict[str, int], *, verification: int = 0) -> s_tir.Schedule:
    """A schedule of the tuning module at ``knobs`` (its trace is a record of that point),
    marked as measured in ``verification`` when non-zero."""
    sch = s_tir.Schedule(mod)
    design_space(sch, fixed=knobs)
    if verification:
        sch.annotate(sch.get_sblock(BLOCK), VERIFIED_KEY, verification)
    return sch


def design_space(sch: s_tir.Schedule, fixed: dict[str, int] | None = None) -> None:
    """Sample every knob of the workload uniformly from its candidates and annotate the block;
    ``fixed`` pins knobs to given values (the hand-picked point of the space)."""
    block = sch.get_sblock(BLOCK)
    space = json.loads(str(sch.get(block).annotations[SPACE_KEY]))
    for name, candidates in sorted(space.items()):
        candidates = [int(c) for c in candidates]
        decision = candidates.index(fixed[name]) if fixed and fixed.get(name) in candidates else None
        value = sch.sample_categorical(candidates=candidates, probs=[1.0 / len(candidates)] * len(candidates),
                                       decision=decision)
        sch.annotate(block, KNOB_PREFIX + name, value)


def _rule_of(mod: tvm.IRModule, target: tvm.target.Target):
    workload, knobs = knobs_of(mod)
    return rule_for(workload.op, target), workload, knobs


@derived_object
class ValidKnobs(ms.postproc.PyPostproc):
    """Rejects a sampled knob combination the kernel cannot be built with (before measuring)."""

    def __init__(self, target: tvm.target.Target | None = None):
        self.target = target

    def _initialize_with_tune_context(self, context: ms.TuneContext) -> None:
        self.target = context.target

    def apply(self, sch: s_tir.Schedule) -> bool:
        rule, workload, knobs = _rule_of(sch.mod, self.target)
        try:
            rule.knobs(workload, self.target, knobs)
        except ValueError:
            return False
        return True

    def clone(self) -> ms.postproc.Postproc:
        return ValidKnobs(self.target)


@derived_object
class KnobMutator(ms.mutator.PyMutator):
    """Moves one knob of a trace to another of its candidates (evolutionary search's mutation)."""

    def __init__(self, seed: int = 0):
        self.random = random.Random(seed)

    def _initialize_with_tune_context(self, context: ms.TuneContext) -> None:
        pass

    def apply(self, trace: s_tir.schedule.Trace, rand_state: int) -> s_tir.schedule.Trace | None:
        samples = [inst for inst in trace.insts if inst.kind.name == "SampleCategorical"
                   and len(inst.attrs[0]) > 1]
        if not samples:
            return None
        self.random.seed((self.random.getrandbits(32) << 32) ^ int(rand_state))
        inst = self.random.choice(samples)
        current = int(trace.decisions[inst])
        choice = self.random.choice([i for i in range(len(inst.attrs[0])) if i != current])
        return trace.with_decision(inst, choice, remove_postproc=True)

    def clone(self) -> ms.mutator.Mutator:
        return KnobMutator(self.random.getrandbits(31))


@derived_object
class KnobFeatures(ms.feature_extractor.PyFeatureExtractor):
    """Features of a candidate for the cost model: log2 of each knob, the register-tile shapes,
    the per-task scratch (does it fit L1/L2?) and the task count per core."""

    def extract_from(self, context: ms.TuneContext, candidates) -> list:
        threads = cores(context.target)
        rows = []
        for candidate in candidates:
            rule, workload, knobs = _rule_of(candidate.sch.mod, context.target)
            full = rule.knobs(workload, context.target, knobs)  # candidates passed ValidKnobs
            rows.append(tvm.runtime.tensor(np.array([_features(workload, full, threads)], dtype="float32")))
        return rows


def _features(workload: Workload, knobs: dict[str, int], cores: int) -> list[float]:
    get = lambda name: float(knobs.get(name, 0 if name == "prefetch" else 1))  # noqa: E731
    d = workload.spec.head_dim
    lanes = get("lanes")
    scratch = 4 * (get("block_q") * get("block_k") * 2 + (get("block_q") + 2 * get("block_k")) * d)
    dims = workload.dim
    tasks = float(dims.get("B") or 1) * workload.spec.num_kv_heads / get("kv_heads") * get("splits")
    if "Sq" in dims and dims["Sq"] and not workload.grads:
        tasks *= max(1.0, dims["Sq"] * workload.spec.group / get("block_q"))
    return [math.log2(1.0 + get(name)) for name in FEATURE_KNOBS] + [
        math.log2(get("micro_rows") * get("key_vecs")),  # accumulators of the q.k^T register tile
        math.log2(get("micro_rows") * get("dim_vecs")),  # ... of the p.v register tile
        math.log2(max(1.0, -(-d // (get("dim_vecs") * lanes)) * get("dim_vecs") * lanes / d)),  # head-dim padding
        math.log2(scratch), math.log2(max(tasks / cores, 1e-3)),
    ]


def space_generator(seed: int = 0) -> ms.space_generator.ScheduleFn:
    """The fuel design space with its mutator and validity check (no stock rules or postprocs)."""
    return ms.space_generator.ScheduleFn(design_space, sch_rules=[], postprocs=[ValidKnobs()],
                                         mutator_probs={KnobMutator(seed): 1.0})
