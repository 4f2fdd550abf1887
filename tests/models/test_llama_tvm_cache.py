"""The Llama decoder served from TVM's runtime paged KV cache (``tvm_fuel.models.llama_tvm_cache``)
generates PyTorch's greedy tokens under continuous batching.

One engine per kernel set (fuel's ``FuelPagedKVCache``, TVM's ``TIRPagedKVCache``) runs one
scenario: sequences join mid-run (their prompts prefilled in the same step as the others' decode
tokens), leave, and fork (at a page boundary and within a page, the child continuing with tokens
of its own over the shared pages), in steps of varying membership and order. Each sequence's
greedy tokens must be those PyTorch generates from the same given tokens (its prompt; for a fork,
the parent's tokens at the fork and the child's own), PyTorch running the whole sequence at every
step (no cache), and the logits of every token fed must match PyTorch's over the whole sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

from tvm_fuel.models import llama, peers
from tvm_fuel.models.llama_tvm_cache import LlamaCacheEngine

# one worker: each engine (a module fixture) is built once
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("test_llama_tvm_cache")]

CONFIG = llama.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=2,
                           head_dim=64)  # GQA groups of 4; head dim 64 (fuel's cache kernels' smallest tested)
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["fuel", "tvm"])
def engine(request) -> LlamaCacheEngine:
    return LlamaCacheEngine(CONFIG, kernels=request.param, seed=7, max_batch_size=8, max_total_seq_len=1024,
                            prefill_chunk_size=128)


def test_the_cache_holds_the_chosen_kernels(engine):
    """The creation call passes fuel's kernels for the attention slots the scenario below runs
    (prefill over new keys and over pages, decode, merging partial states) and none of TVM's
    there with kernels="fuel"; TVM's (by their symbols) and none of fuel's with kernels="tvm"."""
    passed = []
    relax.analysis.post_order_visit(engine.module["create_paged_kv_cache"],
                                    lambda e: passed.append(e.name_hint) if isinstance(e, relax.GlobalVar) else None)
    ours = {f"fuel_tir_attention_{slot}_cpu" for slot in ("prefill_ragged", "prefill", "decode", "merge_state")}
    theirs = {"batch_prefill_ragged_kv", "batch_prefill_paged_kv_cpu", "batch_decode_paged_kv_cpu",
              "merge_state_inplace_cpu"}
    if engine.kernels == "fuel":  # nor TVM's sliding-window and tree kernels
        theirs |= {"batch_prefill_paged_kv_cpu_sliding_window", "batch_decode_paged_kv_cpu_sliding_window",
                   "batch_tree_attn", "tree_attn_paged_kv_cpu"}
        assert ours <= set(passed) and not theirs & set(passed), passed
    else:
        assert theirs <= set(passed) and not any(name.startswith("fuel_") for name in passed), passed


class _Sequence:
    """A sequence as the test drives it: ``tokens`` (those in the cache, then the one to feed
    next), of which the first ``given`` were not generated, and the engine's logits of each
    token in the cache (``rows``)."""

    def __init__(self, tokens: list[int], fed: int = 0, rows: list[np.ndarray] | None = None):
        self.tokens, self.fed, self.given, self.rows = list(tokens), fed, len(tokens), list(rows or [])


class _Run:
    def __init__(self, engine: LlamaCacheEngine):
        self.engine, self.live, self.all = engine, {}, []

    def add(self, seq: int, prompt: list[int]):
        self.engine.add_sequence(seq)
        self.live[seq] = _Sequence(prompt)
        self.all.append(self.live[seq])

    def fork(self, parent: int, child: int, own: list[int]):
        """``child`` holds ``parent``'s tokens in the cache, then goes on with ``own`` (not the
        parent's next token)."""
        self.engine.fork_sequence(parent, child)
        p = self.live[parent]
        assert own[0] != p.tokens[p.fed]  # a continuation of its own
        self.live[child] = _Sequence(p.tokens[:p.fed] + own, fed=p.fed, rows=p.rows)
        self.all.append(self.live[child])

    def remove(self, seq: int):
        self.engine.remove_sequence(seq)
        del self.live[seq]

    def step(self, seqs: list[int]):
        logits = self.engine.step(seqs, [self.live[s].tokens[self.live[s].fed:] for s in seqs])
        for seq, rows in zip(seqs, logits):
            s = self.live[seq]
            assert rows.shape == (len(s.tokens) - s.fed, CONFIG.vocab_size)
            s.rows.extend(rows)
            s.fed = len(s.tokens)
            s.tokens.append(int(rows[-1].argmax()))  # greedy
            assert self.engine.length(seq) == s.fed


def _torch_greedy(weights: dict, given: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """PyTorch's greedy tokens after ``given`` and the logits each was picked from, the whole
    sequence run at every step (no cache)."""
    tokens, logits = list(given), []
    for _ in range(steps):
        logits.append(peers.torch_llama_logits(CONFIG, weights, np.array([tokens]))[0, -1])
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(given):], logits


def test_continuous_batching_generates_torch_greedy_tokens(engine):
    pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    prompt = lambda n: [int(t) for t in rng.integers(0, CONFIG.vocab_size, n)]  # noqa: E731
    run = _Run(engine)
    run.add(0, prompt(17))
    run.add(1, prompt(11))
    run.step([0, 1])  # two prompts prefilled together
    run.step([0, 1])
    run.step([1, 0])  # decode, packed in another order
    run.add(2, prompt(9))
    run.step([0, 2, 1])  # 2's prompt in the same step as 0's and 1's decode tokens
    run.step([0, 1, 2])
    run.remove(0)  # leaves mid-run
    run.step([2, 1])
    assert engine.length(1) == 16
    run.fork(1, 3, [(run.live[1].tokens[-1] + 1) % CONFIG.vocab_size, 5])  # at a page boundary
    run.step([1, 3, 2])  # 3: two tokens over the pages it shares with 1 (prefill over a cached prefix)
    for _ in range(3):
        run.step([1, 2, 3])
    run.add(4, prompt(33))  # over three pages
    run.fork(2, 5, [(run.live[2].tokens[-1] + 7) % CONFIG.vocab_size])  # within a page (copied in part)
    run.step([3, 4, 5])  # 1 and 2 sit this step out
    for _ in range(2):
        run.step([1, 2, 3, 4, 5])
    run.remove(1)  # the parent leaves, its child 3 stays on the shared pages
    for _ in range(3):
        run.step([2, 3, 4, 5])
    for seq in list(run.live):
        run.remove(seq)

    for index, s in enumerate(run.all):
        where = f"sequence {index}: {s.given} tokens given, {len(s.tokens) - s.given} generated"
        want = peers.torch_llama_logits(CONFIG, engine.weights, np.array([s.tokens[:s.fed]]))[0]
        np.testing.assert_allclose(np.stack(s.rows), want, atol=TOLERANCE, rtol=TOLERANCE, err_msg=where)
        tokens, logits = _torch_greedy(engine.weights, s.tokens[:s.given], len(s.tokens) - s.given)
        assert s.tokens[s.given:] == tokens, where
        np.testing.assert_allclose(np.stack(s.rows[s.given - 1:]), np.stack(logits), atol=TOLERANCE,
                                   rtol=TOLERANCE, err_msg=where)


def test_bad_arguments_name_the_method_and_argument(engine):
    engine.add_sequence(100)
    try:
        with pytest.raises(ValueError, match="LlamaCacheEngine.add_sequence: seq_id 100 is already a sequence"):
            engine.add_sequence(100)
        with pytest.raises(ValueError, match="LlamaCacheEngine.add_sequence: seq_id must be a non-negative int"):
            engine.add_sequence(-1)
        with pytest.raises(ValueError, match="LlamaCacheEngine.remove_sequence: seq_id 101 is no sequence"):
            engine.remove_sequence(101)
        with pytest.raises(ValueError, match="LlamaCacheEngine.fork_sequence: parent 101 is no sequence"):
            engine.fork_sequence(101, 102)
        with pytest.raises(ValueError, match="LlamaCacheEngine.fork_sequence: child 100 is already a sequence"):
            engine.fork_sequence(100, 100)
        with pytest.raises(ValueError, match="LlamaCacheEngine.step: seq_ids entry 101 is no sequence"):
            engine.step([100, 101], [[1], [2]])
        with pytest.raises(ValueError, match="LlamaCacheEngine.step: tokens for sequence 100 must be a non-empty"):
            engine.step([100], [[]])
        with pytest.raises(ValueError, match=r"LlamaCacheEngine.step: token ids must be in \[0, vocab_size=128\)"):
            engine.step([100], [[3, 128]])
        with pytest.raises(ValueError, match="LlamaCacheEngine.step: seq_ids must not repeat a sequence"):
            engine.step([100, 100], [[1], [2]])
        with pytest.raises(ValueError, match="LlamaCacheEngine.step: tokens hold 129 tokens, more than "
                                             "prefill_chunk_size 128"):
            engine.step([100], [[1] * 129])
        assert engine.length(100) == 0  # nothing reached the cache
        assert [rows.shape for rows in engine.step([100], [[1, 2, 3]])] == [(3, CONFIG.vocab_size)]
        assert engine.length(100) == 3
    finally:
        engine.remove_sequence(100)
