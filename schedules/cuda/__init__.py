"""CUDA kernels of the fuel ops (sm_80, sm_90) and their rules.

Contents:
    device   -- Launch (threads / emulation on llvm), TileOps (syncs, copies, pipeline, SIMT GEMM)
    mma      -- warp register tiles (ldmatrix + mma.sync, quad reductions) and their lane-faithful emulation
    tiles    -- CudaTiles, WarpLayout and shared-memory sizes
    forward  -- dense flash attention forward and paged attention (split-KV); forward_registers: its
                register-tile (mma.sync) path for float16/bfloat16
    varlen   -- FlashAttention's packed variable-length forward (cu_seqlens) over the forward's blocks
    backward -- flash attention backward (FlashAttention-2 structure); backward_registers: its
                register-tile path
    varlen_backward -- the packed variable-length backward over the backward's blocks
    rules    -- the rules that put them in place of the floor on cuda targets
"""
