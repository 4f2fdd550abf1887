"""``python -m tvm_fuel bench``: the floor, the tuned kernels and PyTorch side by side, as ratios.

Contents:
    attention    -- the flash and paged rows, this machine's peaks, the chart
    decoder      -- the demo decoder against PyTorch
    higher_order -- forward mode and the double backward
    norm         -- the norms' backward, fused or not
    varlen       -- a packed batch of prompts (flash_attn_varlen) against padding and PyTorch per prompt
    models       -- an exported Hugging Face model against PyTorch eager and torch.compile (--models)
    timing       -- how the end-to-end rows alternate their contenders

The benchmark's shapes and their work (FLOPs, K/V bytes) are ``tvm_fuel.testing.cases``.
"""
