"""CPU (llvm) kernels of the performance path.

Modules:
    rules           -- the dlight-style rules that put the kernels in place of the floor
    tiles           -- the knobs (tile sizes, vector lanes, splits) and their spaces, from the target
    micro           -- register-tiled GEMMs, online softmax, lane reductions (TVMScript macros)
    tasks           -- the task skeletons the kernels share (split partials)
    forward         -- flash_attn and paged_attn
    ragged          -- the ragged-batch tasks and prefill phases tvm_cache and varlen share
    tvm_cache       -- the attention slots of TVM's own paged KV cache (relax.frontend.nn.llm)
    varlen          -- flash_attn_varlen's packed variable-length forward (varlen_forward)
    backward        -- flash_attn_backward (dq, dk, dv)
    varlen_backward -- flash_attn_varlen_backward's packed variable-length backward (the backward's tasks per sequence)
    tangent         -- the tangent pass, and flash_attn_jvp on it
    double_backward -- flash_attn_double_backward
    norm            -- layer_norm_backward, rms_norm_backward
    generic         -- default schedules of a model's other TIR functions (their rules, in order)
    matmul          -- the default schedules of its matmuls (register tiles, weights in panels, decode rows)
    rule_steps      -- what the default rules share (exact inlining, a GEMM's blocks)
    common          -- prefetch, absent inputs, the parameter bundles' base
"""
