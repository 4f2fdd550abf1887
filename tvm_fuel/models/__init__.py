"""End-to-end models built on the fuel ops (random weights made on the fly; no downloads).

Contents:
    llama    -- a small Llama-style decoder (RoPE, GQA, RMSNorm, SwiGLU) as a
                ``tvm.relax.frontend.nn`` module: ``forward`` (no cache, ``flash_attn``),
                ``prefill`` (``flash_attn``, K/V written into a paged cache) and ``decode``
                (``paged_attn`` over the cache)
    engine   -- compiles the decoder and runs greedy generation over a ``PagedKVCache``
    llama_tvm_cache -- the decoder over TVM's runtime paged KV cache (fuel's kernels in it), MLC-LLM style
    train    -- a small attention model trained through ``relax.transform.Gradient`` and an
                optimizer
    peers    -- the same models in numpy and in PyTorch, to check the compiled ones against
"""
