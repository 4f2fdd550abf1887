"""CUDA kernels of the fuel ops (sm_80, sm_90) and their rules.

Contents:
    device   -- Launch (threads / emulation on llvm), TileOps (syncs, WMMA or SIMT tile GEMMs)
    tiles    -- CudaTiles and shared-memory sizes
    forward  -- dense flash attention forward and paged attention (split-KV)
    backward -- flash attention backward (FlashAttention-2 structure)
    rules    -- the rules that put them in place of the floor on cuda targets
"""
