"""``python -m tvm_fuel demo``: the ops, a decoder serving loop and a training run, built and run.

1. **ops**: one small Relax module that uses every fuel op, built through the floor, each
   output compared with ``tvm_fuel.reference``.
2. **decoder**: the Llama-style decoder (``tvm_fuel.models``) generating greedily for a batch of
   prompts of different lengths: prefill through ``flash_attn``, decode through ``paged_attn``
   over a ``PagedKVCache``; tokens/s of the floor, of the tuned build (kernels and the model's
   other functions from the shipped logs, which it reports) and of PyTorch eager over its own
   KV cache (same weights, same greedy tokens); the decode logits against the model run without
   a cache over the full sequences, and against PyTorch.
3. **training**: the attention model's loss curve under the Gradient pass and Adam, and the
   decoder's (next-token cross entropy, no hand-written gradient), against PyTorch's autograd
   and Adam.
4. **second-order**: training with a gradient penalty on the attention inputs
   (loss + lambda |dloss/dq|^2) through ``flash_attn_double_backward`` (Gradient applied to the
   adjoint), fused kernels against the ops expanded to Relax primitives and against PyTorch's
   math-backend double backward; a Hessian-vector product against the float64 reference.

``--quick`` runs the ops part alone (``--parts ops``). Every comparison is a ``Check``; the
command fails if any is out of tolerance. PyTorch comparisons run when PyTorch is installed.

Contents:
    Check, build_demo_module, demo_inputs, run_demo, run_ops, run_decoder, run_training, run_second_order
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from . import op
from . import reference as ref
from .build import compile as fuel_compile

B, HQ, HKV, SQ, SK, D = 2, 6, 2, 17, 40, 64
NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 12, 16, 4
OPTIONS = dict(causal=True, softcap=20.0)


@dataclass(frozen=True)
class Check:
    """A measured error (``error``, what ``measure`` says) and the most it may be."""

    name: str
    error: float
    tolerance: float
    measure: str = "max |err|"

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


def _print_checks(checks: list[Check]) -> None:
    for c in checks:
        print(f"  {c.name:<40} {c.measure:>12} {c.error:>10.3e}  tolerance {c.tolerance:.0e}  "
              f"{'ok' if c.ok else 'MISMATCH'}")


def build_demo_module() -> tvm.IRModule:
    """A training-and-serving flavoured graph: forward with lse, its backward, paged decode."""
    ty = relax.TensorType
    params = [
        relax.Var("q", ty((B, HQ, SQ, D), "float32")), relax.Var("k", ty((B, HKV, SK, D), "float32")),
        relax.Var("v", ty((B, HKV, SK, D), "float32")), relax.Var("do", ty((B, HQ, SQ, D), "float32")),
        relax.Var("alibi_slopes", ty((HQ,), "float32")),
        relax.Var("k_cache", ty((NUM_BLOCKS, BLOCK_SIZE, HKV, D), "float32")),
        relax.Var("v_cache", ty((NUM_BLOCKS, BLOCK_SIZE, HKV, D), "float32")),
        relax.Var("block_table", ty((B, MAX_BLOCKS), "int32")), relax.Var("context_lens", ty((B,), "int32")),
    ]
    q, k, v, do, slopes, k_cache, v_cache, table, lens = params
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            fwd = bb.emit(op.flash_attn(q, k, v, slopes, **OPTIONS, return_lse=True))
            out, lse = bb.emit(relax.TupleGetItem(fwd, 0)), bb.emit(relax.TupleGetItem(fwd, 1))
            grads = bb.emit(op.flash_attn_backward(q, k, v, do, slopes, out=out, lse=lse, **OPTIONS))
            dq_only = bb.emit(op.flash_attn_backward_q(q, k, v, do, slopes, **OPTIONS))
            dk_only = bb.emit(op.flash_attn_backward_k(q, k, v, do, slopes, **OPTIONS))
            dv_only = bb.emit(op.flash_attn_backward_v(q, k, v, do, slopes, **OPTIONS))
            decode = bb.emit(op.paged_attn(q, k_cache, v_cache, table, lens, slopes, **OPTIONS))
            probs = bb.emit(relax.op.nn.softmax(q, axis=-1))
            dlogits = bb.emit(op.softmax_backward(probs, do))
            result = bb.emit_output(relax.Tuple([out, lse, grads, dq_only, dk_only, dv_only, decode, dlogits]))
        bb.emit_func_output(result)
    return bb.get()


def demo_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    table = np.full((B, MAX_BLOCKS), -1, np.int32)  # -1 pads the dead entries
    table[0, :2] = [7, 2]
    table[1, :4] = [7, 11, 0, 5]  # block 7 shared by both sequences
    f32 = np.float32
    return dict(
        q=rng.standard_normal((B, HQ, SQ, D)).astype(f32), k=rng.standard_normal((B, HKV, SK, D)).astype(f32),
        v=rng.standard_normal((B, HKV, SK, D)).astype(f32), do=rng.standard_normal((B, HQ, SQ, D)).astype(f32),
        alibi_slopes=(rng.random(HQ) * 0.1).astype(f32),
        k_cache=rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, HKV, D)).astype(f32),
        v_cache=rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, HKV, D)).astype(f32),
        block_table=table, context_lens=np.array([20, 61], np.int32))


def _expected(x: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    qkv = (x["q"], x["k"], x["v"])
    out, lse = ref.flash_attn(*qkv, x["alibi_slopes"], **OPTIONS, return_lse=True)
    dq, dk, dv = ref.flash_attn_backward(*qkv, x["do"], x["alibi_slopes"], **OPTIONS)
    logits = x["q"].astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    decode = ref.paged_attn(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["context_lens"],
                            x["alibi_slopes"], **OPTIONS)
    return [("flash_attn out", out), ("flash_attn lse", lse), ("flash_attn_backward dq", dq),
            ("flash_attn_backward dk", dk), ("flash_attn_backward dv", dv), ("flash_attn_backward_q", dq),
            ("flash_attn_backward_k", dk), ("flash_attn_backward_v", dv), ("paged_attn", decode),
            ("softmax_backward", ref.softmax_backward(probs, x["do"]))]


def _flatten(value) -> list[np.ndarray]:
    if isinstance(value, tvm.runtime.Tensor):
        return [value.numpy()]
    return [array for item in value for array in _flatten(item)]


def run_ops(*, target="llvm", seed: int = 0, tolerance: float = 1e-4) -> list[Check]:
    """Build the every-op module through the correctness floor, run it, compare with the reference."""
    mod = build_demo_module()
    start = time.perf_counter()
    executable = fuel_compile(mod, target)
    built = time.perf_counter() - start
    inputs = demo_inputs(seed)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    start = time.perf_counter()
    outputs = _flatten(vm["main"](*[tvm.runtime.tensor(a) for a in inputs.values()]))
    ran = time.perf_counter() - start
    checks = []
    for got, (name, want) in zip(outputs, _expected(inputs)):
        finite = np.isfinite(want)
        same_inf = bool(np.array_equal(np.isfinite(got), finite))
        err = float(np.abs(got[finite] - want[finite]).max()) if finite.any() else 0.0
        checks.append(Check(name, err if same_inf else float("inf"), tolerance))
    print(f"[ops] every fuel op in one module: B={B} Hq={HQ} Hkv={HKV} Sq={SQ} Sk={SK} D={D} causal softcap "
          f"ALiBi, paged block_size={BLOCK_SIZE}; kernels=decomposed, built in {built:.1f} s, ran in "
          f"{ran * 1e3:.1f} ms; vs tvm_fuel.reference:")
    _print_checks(checks)
    return checks


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def run_decoder(*, target="llvm", seed: int = 0, prompt_lens=(17, 200, 500, 1000), new_tokens: int = 32) -> list[Check]:
    """Greedy generation with the floor and the tuned kernels; their tokens/s; decode logits vs the
    full-sequence forward (and PyTorch)."""
    from .models import llama, peers
    from .models.engine import LlamaEngine

    config = llama.LlamaConfig()
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in prompt_lens]
    print(f"[decoder] Llama-style, {config.num_layers} layers, hidden {config.hidden_size}, Hq={config.num_heads} "
          f"Hkv={config.num_kv_heads} D={config.head_dim}, RoPE, RMSNorm, SwiGLU, random weights; "
          f"{len(prompts)} prompts of {list(prompt_lens)} tokens, {new_tokens} new tokens each (greedy)")
    results, engines, attention = {}, {}, {}
    num_blocks = sum(-(-(n + new_tokens) // 16) for n in prompt_lens)  # room for every sequence at once
    for kernels in ("decomposed", "tuned"):
        engine = LlamaEngine(config, target=target, kernels=kernels, num_blocks=num_blocks, block_size=16, seed=seed)
        engine.generate(prompts[:1], max_new_tokens=2)  # warm up
        runs = [engine.generate(prompts, max_new_tokens=new_tokens) for _ in range(2)]  # the faster of two
        results[kernels], engines[kernels] = min(runs, key=lambda r: r.prefill_s + r.decode_s), engine
        attention[kernels] = engine.generate(prompts, max_new_tokens=new_tokens, time_attention=True).attention_s
        r, a = results[kernels], attention[kernels]
        print(f"  {kernels:<10} built in {engine.build_s:5.1f} s   "
              f"prefill {sum(prompt_lens) / r.prefill_s:7.0f} tokens/s "
              f"(attention {a['prefill'] * 1e3:6.1f} ms)   decode {r.decode_tokens_per_s:6.0f} tokens/s "
              f"(attention {a['decode'] * 1e3 / (new_tokens - 1):5.2f} ms/step)")
    floor, tuned = results["decomposed"], results["tuned"]
    speedup = {phase: attention["decomposed"][phase] / attention["tuned"][phase] for phase in ("prefill", "decode")}
    print(f"  tuned / floor: decode tokens/s {tuned.decode_tokens_per_s / floor.decode_tokens_per_s:.2f}x, "
          f"attention time prefill {speedup['prefill']:.1f}x, decode {speedup['decode']:.1f}x faster; "
          f"same tokens: {floor.tokens == tuned.tokens}")
    applied = engines["tuned"].records()
    print(f"  tuned build: {applied['kernels']} of {applied['kernel_total']} attention kernels and "
          f"{applied['functions']} of {applied['function_total']} other TIR functions from tuning records "
          f"({', '.join(applied['sources']) or 'none'}); the rest hand-picked knobs and default schedules")
    checks = []
    if _torch_available():
        from .models.peers import torch_generate

        torch_generate(config, engines["tuned"].weights, prompts[:1], max_new_tokens=2)  # warm up
        peer = min((torch_generate(config, engines["tuned"].weights, prompts, max_new_tokens=new_tokens)
                    for _ in range(2)), key=lambda r: r.prefill_s + r.decode_s)
        prefill = {name: sum(prompt_lens) / r.prefill_s for name, r in (("tuned", tuned), ("torch", peer))}
        print(f"  PyTorch eager (KV cache)        prefill {prefill['torch']:7.0f} tokens/s"
              f"{'':21}decode {peer.decode_tokens_per_s:6.0f} tokens/s")
        print(f"  tuned / PyTorch: prefill tokens/s {prefill['tuned'] / prefill['torch']:.2f}x, decode tokens/s "
              f"{tuned.decode_tokens_per_s / peer.decode_tokens_per_s:.2f}x; "
              f"same tokens: {peer.tokens == tuned.tokens}")
        differing = sum(a != b for ours, theirs in zip(tuned.tokens, peer.tokens) for a, b in zip(ours, theirs))
        checks.append(Check("greedy tokens differing from PyTorch's", float(differing), 0.0, "count"))
    errors, floor_errors, torch_errors = [], [], []
    for kernels, result in results.items():  # each build's cached paths against its own no-cache forward
        for row, prompt in enumerate(prompts):
            full = np.array([prompt + result.tokens[row][:-1]])
            logits = engines[kernels].forward(full)[0]  # no cache: flash_attn over the whole sequence
            decoded = np.stack([step[row] for step in result.decode_logits])
            errors += [np.abs(decoded - logits[len(prompt):]).max(),
                       np.abs(result.prefill_logits[row] - logits[:len(prompt)]).max()]
            if kernels == "tuned":
                floor_errors.append(np.abs(engines["decomposed"].forward(full)[0] - logits).max())
                if _torch_available():
                    peer = peers.torch_llama_logits(config, engines["tuned"].weights, full)[0]
                    torch_errors.append(np.abs(logits - peer).max())
    checks = [Check("paged decode vs no-cache full sequence", float(max(errors)), 1e-4),
              Check("tuned vs floor logits", float(max(floor_errors)), 1e-4)] + checks
    if torch_errors:
        checks.append(Check("full-sequence logits vs PyTorch", float(max(torch_errors)), 5e-4))
    else:
        print("  (PyTorch is not installed: no PyTorch comparison)")
    _print_checks(checks)
    return checks


def run_training(*, target="llvm", seed: int = 0, steps: int = 10) -> list[Check]:
    """The attention model's loss curve (Gradient pass + Adam), and PyTorch's for the same start."""
    from .models import peers, train

    config = train.TrainConfig()
    trainer = train.Trainer(config, target=target, kernels="tuned", seed=seed)
    start = time.perf_counter()
    losses = trainer.fit(steps=steps)
    took = time.perf_counter() - start
    print(f"[training] causal GQA attention (Hq={config.num_heads} Hkv={config.num_kv_heads} D={config.head_dim}, "
          f"softcap {config.softcap}) + projections, MSE to a teacher, Adam lr {config.lr}; built in "
          f"{trainer.build_s:.1f} s, {steps} steps in {took * 1e3:.0f} ms")
    print("  loss: " + " ".join(f"{loss:.4f}" for loss in losses))
    checks = [Check("final loss / first loss", losses[-1] / losses[0], 0.5, "ratio"),
              Check("steps where the loss rose", float(sum(b >= a for a, b in zip(losses, losses[1:]))), 0.0,
                    "count")]
    if _torch_available():
        curve = peers.torch_fit(config, trainer.initial_weights, trainer.x, trainer.y, steps=steps)
        print("  torch " + " ".join(f"{loss:.4f}" for loss in curve))
        checks.append(Check("loss curve vs PyTorch autograd + Adam",
                            float(max(abs(a - b) / b for a, b in zip(losses, curve))), 1e-4, "max rel err"))
    else:
        print("  (PyTorch is not installed: no PyTorch comparison)")
    checks += _train_decoder(target, seed)
    _print_checks(checks)
    return checks


def _train_decoder(target, seed: int, steps: int = 10) -> list[Check]:
    """The demo decoder trained on next-token cross entropy through Gradient (no hand-written
    gradient: flash_attn's fused backward, the norms' from ``tvm_fuel.autodiff``), against PyTorch."""
    from .models import llama, peers
    from .models.train import DecoderTrainer

    trainer = DecoderTrainer(llama.LlamaConfig(), target=target, kernels="tuned", seed=seed)
    start = time.perf_counter()
    losses = trainer.fit(steps=steps)
    took = time.perf_counter() - start
    batch, seq_len = trainer.tokens.shape
    print(f"  decoder (RMSNorm, RoPE, GQA flash attention, SwiGLU): next-token cross entropy on {batch} random "
          f"sequences of {seq_len + 1} tokens, Adam lr {trainer.lr}; built in {trainer.build_s:.1f} s, "
          f"{steps} steps in {took * 1e3:.0f} ms")
    print("  loss: " + " ".join(f"{loss:.4f}" for loss in losses))
    checks = [Check("decoder: final loss / first loss", losses[-1] / losses[0], 0.1, "ratio")]
    if _torch_available():
        curve = peers.torch_llama_fit(trainer.config, trainer.initial_weights, trainer.tokens, trainer.targets,
                                      steps=steps, lr=trainer.lr)
        print("  torch " + " ".join(f"{loss:.4f}" for loss in curve))
        checks.append(Check("decoder loss curve vs PyTorch autograd + Adam",
                            float(max(abs(a - b) / b for a, b in zip(losses, curve))), 1e-4, "max rel err"))
    return checks


PENALTY = dict(B=1, Hq=4, Hkv=2, S=33, D=32, lam=0.5, lr=20.0, causal=True)


def _penalty_model(p: dict) -> tvm.IRModule:
    """main(q, k, v, y) -> loss = mean((flash_attn(q, k, v) - y)^2)."""
    shapes = {"q": (p["B"], p["Hq"], p["S"], p["D"]), "k": (p["B"], p["Hkv"], p["S"], p["D"]),
              "v": (p["B"], p["Hkv"], p["S"], p["D"]), "y": (p["B"], p["Hq"], p["S"], p["D"])}
    params = [relax.Var(n, relax.TensorType(shape, "float32")) for n, shape in shapes.items()]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            q, k, v, y = params
            diff = bb.emit(relax.op.subtract(op.flash_attn(q, k, v, causal=p["causal"]), y))
            loss = bb.emit_output(relax.op.mean(relax.op.multiply(diff, diff)))
        bb.emit_func_output(loss)
    return bb.get()


def _penalty_modules(p: dict) -> dict[str, tvm.IRModule]:
    """``penalized`` = loss + lam |dloss/dq|^2 built on the model's adjoint (``with_objective``), and
    its adjoint: second derivatives through the fused double backward ("fused"), or through the
    ops expanded to Relax primitives first ("expanded")."""
    from .transform.expand_attention import ExpandAttention
    from .transform.gradient import gradient, with_objective

    mod = _penalty_model(p)

    def penalized(result):
        loss, grads = result.fields
        dq = grads.fields[0]
        return relax.op.add(loss, relax.op.multiply(relax.const(p["lam"], "float32"),
                                                    relax.op.sum(relax.op.multiply(dq, dq))))

    modules = {}
    for path, base in (("fused", mod), ("expanded", ExpandAttention()(mod))):
        first = gradient(base, require_grads=base["main"].params[:3])
        second = with_objective(first, "main_adjoint", "penalized", penalized)
        modules[path] = gradient(second, "penalized", require_grads=second["penalized"].params[:3])
    return modules


def _torch_penalty_curve(p: dict, arrays: dict, steps: int) -> list[float]:
    """The same gradient-penalty descent in PyTorch (float32, SDPA's math backend, the one with a
    double backward)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.tensor(arrays[n], requires_grad=True) for n in "qkv")
    y = torch.from_numpy(arrays["y"])
    group = p["Hq"] // p["Hkv"]
    curve = []
    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(steps):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=p["causal"])
            loss = ((out - y) ** 2).mean()
            (dq,) = torch.autograd.grad(loss, q, create_graph=True)
            total = loss + p["lam"] * (dq * dq).sum()
            curve.append(float(total.detach()))
            grads = torch.autograd.grad(total, (q, k, v))
            with torch.no_grad():
                for x, g in zip((q, k, v), grads):
                    x -= p["lr"] * g
    return curve


def _hvp_reference(p: dict, arrays: dict, u: np.ndarray) -> np.ndarray:
    """H u of the loss w.r.t. q, float64: J^T (2/N) J u (the loss's curvature) plus the double
    backward with do = 2 (out - y) / N and dq_bar = u (attention's own curvature)."""
    q, k, v, y = (arrays[n].astype(np.float64) for n in "qkvy")
    n = y.size
    out, out_dot = ref.flash_attn_jvp(q, k, v, u, None, None, causal=p["causal"])
    gauss_newton = ref.flash_attn_backward(q, k, v, 2.0 / n * out_dot, causal=p["causal"])[0]
    curvature = ref.flash_attn_double_backward(q, k, v, 2.0 / n * (out - y), u, causal=p["causal"])[0]
    return gauss_newton + curvature


def run_second_order(*, target="llvm", seed: int = 0, steps: int = 5) -> list[Check]:
    """Gradient-penalty descent (fused vs expanded vs PyTorch) and a Hessian-vector product."""
    from .transform.gradient import gradient, with_objective

    p = PENALTY
    rng = np.random.default_rng(seed)
    arrays = {n: rng.standard_normal(shape).astype(np.float32) for n, shape in (
        ("q", (p["B"], p["Hq"], p["S"], p["D"])), ("k", (p["B"], p["Hkv"], p["S"], p["D"])),
        ("v", (p["B"], p["Hkv"], p["S"], p["D"])), ("y", (p["B"], p["Hq"], p["S"], p["D"])))}
    modules = _penalty_modules(p)
    curves, built = {}, {}
    for path, kernels in (("fused", "tuned"), ("expanded", "decomposed")):
        start = time.perf_counter()
        vm = relax.VirtualMachine(fuel_compile(modules[path], target, kernels=kernels), tvm.cpu())
        built[path] = time.perf_counter() - start
        state, curves[path] = {n: arrays[n].copy() for n in "qkv"}, []
        for _ in range(steps):
            total, grads = vm["penalized_adjoint"](*(tvm.runtime.tensor(a) for a in (*state.values(), arrays["y"])))
            curves[path].append(float(total.numpy()))
            for name, g in zip("qkv", grads):
                state[name] = state[name] - p["lr"] * g.numpy()
    print(f"[second-order] loss + {p['lam']} |dloss/dq|^2 over causal GQA attention (B={p['B']} Hq={p['Hq']} "
          f"Hkv={p['Hkv']} S={p['S']} D={p['D']}), {steps} gradient steps (lr {p['lr']}) through Gradient of the "
          f"adjoint: fused (flash_attn_double_backward, CPU kernels, built in {built['fused']:.1f} s) and "
          f"expanded to Relax primitives (ExpandAttention, built in {built['expanded']:.1f} s)")
    for path, curve in curves.items():
        print(f"  {path:<9}" + " ".join(f"{x:.5f}" for x in curve))
    checks = [Check("fused vs expanded penalized loss", max(abs(a - b) / abs(b) for a, b in zip(*curves.values())),
                    1e-4, "max rel err"),
              Check("penalized loss fell", float(curves["fused"][-1] >= curves["fused"][0]), 0.0, "rose")]
    if _torch_available():
        torch_curve = _torch_penalty_curve(p, arrays, steps)
        print("  torch    " + " ".join(f"{x:.5f}" for x in torch_curve))
        checks.append(Check("fused vs PyTorch math double backward",
                            max(abs(a - b) / abs(b) for a, b in zip(curves["fused"], torch_curve)), 1e-4,
                            "max rel err"))
    else:
        print("  (PyTorch is not installed: no PyTorch comparison)")
    # Hessian-vector product of the loss w.r.t. q: the gradient of <dloss/dq, u>
    u = rng.standard_normal(arrays["q"].shape).astype(np.float32)
    model = _penalty_model(p)
    first = gradient(model, require_grads=model["main"].params[:3])
    hvp_mod = with_objective(first, "main_adjoint", "directional", lambda result: relax.op.sum(
        relax.op.multiply(result.fields[1].fields[0], relax.const(u))))
    hvp_mod = gradient(hvp_mod, "directional", require_grads=hvp_mod["directional"].params[:1])
    vm = relax.VirtualMachine(fuel_compile(hvp_mod, target, kernels="tuned"), tvm.cpu())
    _, (hvp,) = vm["directional_adjoint"](*(tvm.runtime.tensor(arrays[n]) for n in "qkvy"))
    want = _hvp_reference(p, arrays, u.astype(np.float64))
    hvp_error = float(np.abs(hvp.numpy() - want).max() / np.abs(want).max())
    print(f"  Hessian-vector product of the loss w.r.t. q (fused kernels) vs the float64 reference: "
          f"{hvp_error:.2e} of its largest entry")
    checks.append(Check("Hessian-vector product vs reference", hvp_error, 1e-4, "rel err"))
    _print_checks(checks)
    return checks


def run_demo(*, target="llvm", seed: int = 0, parts=("ops", "decoder", "training", "second-order")) -> list[Check]:
    """The demo's parts in order; every check of each."""
    runs = {"ops": run_ops, "decoder": run_decoder, "training": run_training, "second-order": run_second_order}
    checks = []
    for part in parts:
        checks += runs[part](target=target, seed=seed)
        print()
    return checks
