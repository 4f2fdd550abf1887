"""What runs on the node: copied into every bundle as ``fuel_node/`` (with ``tvm_fuel.reference``).

It imports nothing of tvm_fuel and nothing of TVM's compiler: Python, numpy, the bundle's
runtime-only TVM and, when present, PyTorch. Modules: ``main`` (the stages, ``run.py``),
``worker`` (one process running cases), ``manifest`` (its schema, checked before anything runs),
``environment`` (the runtime, CUDA, the cubin store),
``arrays`` (seeded inputs), ``compare`` (tolerances), ``peers`` (PyTorch's side), ``tvm_slots``
(TVM's runtime KV-cache slots, fuel's kernels against TVM's).
"""
