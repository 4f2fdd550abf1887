"""Training a small attention model through ``relax.transform.Gradient`` and an optimizer.

The model is one causal GQA attention layer with logit softcap and an output projection,
fitted by mean squared error to the outputs of a teacher of the same shape with other weights
(so the loss has somewhere to go: zero); the teacher is the same compiled model's ``forward``
(the numpy and PyTorch peers in ``models.peers`` only check it). Its Relax module holds
``forward(x, *weights)``, ``loss(x, y, *weights)``, the
adjoint ``loss_adjoint`` that ``tvm_fuel.transform.gradient`` adds (``flash_attn``'s registered
gradient: ``flash_attn_backward`` with the forward's ``out`` and ``lse``), and ``optimizer``,
Relax's Adam (``tvm.relax.training.optimizer``) over the weights. A step is two VM calls.

``DecoderTrainer`` trains the Llama-style decoder (``models.llama``: RMSNorm, RoPE, GQA flash
attention, SwiGLU) on next-token cross entropy over a synthetic corpus the same way: its adjoint
comes from ``tvm_fuel.transform.gradient`` with no hand-written gradient (the norms' from
``tvm_fuel.autodiff``).

Contents:
    TrainConfig, AttentionRegressor, Trainer, init_weights, DecoderTrainer

Example
-------
>>> from tvm_fuel.models import train                          # doctest: +SKIP
>>> trainer = train.Trainer(train.TrainConfig(), target="llvm", kernels="tuned")
>>> losses = trainer.fit(steps=8)                              # decreasing
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.training.optimizer import Adam

from ..build import compile as fuel_compile
from ..nn import FlashAttention
from ..transform.gradient import gradient


@dataclass(frozen=True)
class TrainConfig:
    """x, y [batch, seq_len, model_dim] float32; Hq = num_heads, Hkv = num_kv_heads of head_dim."""

    batch: int = 4
    seq_len: int = 17
    model_dim: int = 48
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 16
    softcap: float = 5.0
    lr: float = 3e-2

    def __post_init__(self):
        for name in ("batch", "seq_len", "model_dim", "num_heads", "num_kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"TrainConfig: {name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TrainConfig: num_heads {self.num_heads} must be a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        if self.softcap < 0 or self.lr <= 0:
            raise ValueError(f"TrainConfig: softcap must be >= 0 and lr > 0, got {self.softcap} and {self.lr}")


class AttentionRegressor(nn.Module):
    """y_hat = o_proj(flash_attn(q_proj(x), k_proj(x), v_proj(x), causal, softcap)); loss = mean((y_hat - y)^2)."""

    def __init__(self, config: TrainConfig):
        c = config
        self.config = c
        self.q_proj = nn.Linear(c.model_dim, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.model_dim, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.model_dim, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.model_dim, bias=False)
        self.attn = FlashAttention(causal=True, softcap=c.softcap)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        c = self.config
        b, s, _ = x.shape
        heads = lambda proj, n: nn.op.permute_dims(nn.op.reshape(proj(x), [b, s, n, c.head_dim]), [0, 2, 1, 3])  # noqa: E731
        out = self.attn(heads(self.q_proj, c.num_heads), heads(self.k_proj, c.num_kv_heads),
                        heads(self.v_proj, c.num_kv_heads))
        return self.o_proj(nn.op.reshape(nn.op.permute_dims(out, [0, 2, 1, 3]), [b, s, c.num_heads * c.head_dim]))

    def loss(self, x: nn.Tensor, y: nn.Tensor) -> nn.Tensor:
        diff = self.forward(x) - y
        return nn.op.sum(diff * diff) * (1.0 / math.prod(int(d) for d in y.shape))

    def spec(self) -> dict:
        c = self.config
        data = nn.spec.Tensor([c.batch, c.seq_len, c.model_dim], "float32")
        plain = {"param_mode": "plain", "effect_mode": "none"}
        return {"forward": {"x": data, "$": plain}, "loss": {"x": data, "y": data, "$": plain}}


def init_weights(config: TrainConfig, names: list[str], *, seed: int) -> dict[str, np.ndarray]:
    """Projections N(0, 1/fan_in), by parameter name."""
    rng = np.random.default_rng(seed)
    shapes = {name: tuple(int(d) for d in p.shape) for name, p in AttentionRegressor(config).named_parameters()}
    return {name: (rng.standard_normal(shapes[name]) / math.sqrt(shapes[name][1])).astype("float32")
            for name in names}


def _adam(lr: float, params: list[relax.Var]) -> Adam:
    """Relax's Adam over ``params``, its state made here: TVM 0.27's ``Adam.init`` hands numpy a
    dtype object numpy cannot read. The state layout is Adam's: (steps, beta1^t, beta2^t, m..., v...)."""
    optimizer = Adam(lr)
    optimizer._set_params_and_dtype(params)  # noqa: SLF001 (init's own checks)
    dtype = str(params[0].ty.dtype)
    zeros = [tvm.runtime.tensor(np.zeros([int(d) for d in p.ty.shape.values], dtype)) for p in params]
    optimizer.state = (tvm.runtime.tensor(np.zeros((), "int64")), tvm.runtime.tensor(np.ones((), dtype)),
                       tvm.runtime.tensor(np.ones((), dtype)), *zeros,
                       *(tvm.runtime.tensor(np.zeros(z.shape, dtype)) for z in zeros))
    return optimizer


class Trainer:
    """Full-batch Adam on one (x, y) batch, every step compiled: ``loss_adjoint`` then ``optimizer``.

    Parameters (keyword-only after ``config``)
    ----------
    config : TrainConfig
    target : str, dict or Target
    kernels : "decomposed" or "tuned"
    seed : int
        Seeds of the student's and teacher's weights and of the batch.
    """

    def __init__(self, config: TrainConfig, *, target="llvm", kernels: str = "decomposed", seed: int = 0):
        self.config = config
        model = AttentionRegressor(config)
        mod, params = model.export_tvm(model.spec())
        self.names = [name for name, _ in params]
        func = mod["loss"]
        weights = list(func.params[2:])
        mod = gradient(mod, "loss", require_grads=weights)
        optimizer = _adam(config.lr, list(mod["loss_adjoint"].params[2:]))
        mod["optimizer"] = optimizer.get_function().with_attr("global_symbol", "optimizer")
        self.module = mod  # loss, loss_adjoint and optimizer, as built
        start = time.perf_counter()
        self.vm = relax.VirtualMachine(fuel_compile(mod, target, kernels=kernels), tvm.cpu())
        self.build_s = time.perf_counter() - start
        self.initial_weights = init_weights(config, self.names, seed=seed)
        self.teacher = init_weights(config, self.names, seed=seed + 1)
        self.x = np.random.default_rng(seed + 2).standard_normal(
            (config.batch, config.seq_len, config.model_dim)).astype("float32")
        self.y = self.vm["forward"](tvm.runtime.tensor(self.x),
                                    *(tvm.runtime.tensor(self.teacher[n]) for n in self.names)).numpy()
        self.weights = [tvm.runtime.tensor(self.initial_weights[n]) for n in self.names]
        self.state = optimizer.state

    def step(self) -> float:
        """One step: the loss at the current weights, then Adam's update."""
        loss, grads = self.vm["loss_adjoint"](tvm.runtime.tensor(self.x), tvm.runtime.tensor(self.y), *self.weights)
        self.weights, self.state = self.vm["optimizer"](self.weights, grads, self.state)
        self.weights = list(self.weights)
        return float(loss.numpy())

    def fit(self, *, steps: int) -> list[float]:
        """``steps`` steps; the loss before each."""
        return [self.step() for _ in range(steps)]


class DecoderTrainer:
    """Full-batch Adam of ``llama.LlamaDecoder.loss`` on ``batch`` random sequences of
    ``seq_len + 1`` tokens (inputs the first ``seq_len``, targets the next ones), the weights of
    ``llama.init_weights(seed)``; ``fit`` returns the loss before each step. ``tokens``,
    ``targets`` (int ids) and ``initial_weights`` are kept for the peers."""

    def __init__(self, config, *, batch: int = 4, seq_len: int = 32, lr: float = 1e-3, target="llvm",
                 kernels: str = "decomposed", seed: int = 0):
        from . import llama

        model = llama.LlamaDecoder(config)
        plain = {"param_mode": "plain", "effect_mode": "none"}
        spec = {"loss": {"tokens": nn.spec.Tensor([batch, seq_len], "int32"),
                         "targets": nn.spec.Tensor([batch, seq_len, config.vocab_size], "float32"),
                         "rope_table": nn.spec.Tensor([2, 1, seq_len, config.head_dim], "float32"), "$": plain}}
        mod, params = model.export_tvm(spec)
        self.names = [name for name, _ in params]
        mod = gradient(mod, "loss", require_grads=list(mod["loss"].params[3:]))
        optimizer = _adam(lr, list(mod["loss_adjoint"].params[3:]))
        mod["optimizer"] = optimizer.get_function().with_attr("global_symbol", "optimizer")
        self.module = mod
        start = time.perf_counter()
        self.vm = relax.VirtualMachine(fuel_compile(mod, target, kernels=kernels), tvm.cpu())
        self.build_s = time.perf_counter() - start
        self.config, self.lr = config, lr
        self.initial_weights = llama.init_weights(config, self.names, seed=seed)
        corpus = np.random.default_rng(seed + 1).integers(0, config.vocab_size, (batch, seq_len + 1))
        self.tokens, self.targets = corpus[:, :-1].astype("int32"), corpus[:, 1:]
        one_hot = np.eye(config.vocab_size, dtype="float32")[self.targets]
        self._inputs = [tvm.runtime.tensor(self.tokens), tvm.runtime.tensor(one_hot),
                        tvm.runtime.tensor(llama.rope_angles(seq_len, config.head_dim, config.rope_theta))]
        self.weights = [tvm.runtime.tensor(self.initial_weights[n]) for n in self.names]
        self.state = optimizer.state

    def step(self) -> float:
        loss, grads = self.vm["loss_adjoint"](*self._inputs, *self.weights)
        self.weights, self.state = self.vm["optimizer"](self.weights, grads, self.state)
        self.weights = list(self.weights)
        return float(loss.numpy())

    def fit(self, *, steps: int) -> list[float]:
        return [self.step() for _ in range(steps)]
