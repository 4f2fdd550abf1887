"""The shared test-and-bench helpers: a leaf below the library and the tools (it imports nothing
of tvm_fuel but ``tvm_fuel.reference``, and nothing of TVM), so that tuning, the bench, the deploy
bundle and the tests all read the same shapes, inputs and tolerances.

The GPU bundle copies ``arrays``, ``compare`` and ``peers`` into its ``fuel_node/`` beside
``tvm_fuel.deploy.node`` (which imports them as siblings): keep them to Python, numpy and, when
present, ml_dtypes and PyTorch.

Contents:
    cases   -- the benchmark's shapes and their work (FLOPs, K/V bytes), CPU and CUDA
    arrays  -- a case's inputs from seeded fills (the same arrays wherever they are made)
    compare -- tolerances per dtype and one output against its expected values
    peers   -- PyTorch's side of a comparison (SDPA, vLLM-style paged decode) and its timing
"""
