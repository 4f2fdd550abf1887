"""Deploy bundles: build every module here, run them where the GPUs are with the TVM runtime alone.

``python -m tvm_fuel bundle --target cuda --arch sm_90 --suite all --out DIR`` builds the
modules a suite needs (``suites``), compiles their CUDA C to cubins with nvcc, copies a
runtime-only TVM and the tvm_ffi wheel for the node's Python, and writes ``DIR/manifest.json``
and ``DIR/run.py`` (``bundle``). ``node`` is what runs there.

Contents:
    suites  -- the cases of each stage (smoke, check, bench, tune) for a target
    bundle  -- build_bundle, tune_bucket
    runtime -- the runtime-only TVM and the wheels the node's Python needs
    imports -- ``tune --import``: a node's tune measurements as tuning records
    node    -- run.py, its supervisor and workers (copied into the bundle)
    node_code -- the node's code as a bundle holds it (``fuel_node/``: node, testing modules, reference)
"""
