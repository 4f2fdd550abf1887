"""What runs on the node: copied into every bundle as ``fuel_node/``, where
``fuel_node/ = deploy/node + testing/{arrays,compare,peers} + reference`` (``deploy.node_code``).

It imports nothing of tvm_fuel and nothing of TVM's compiler: Python, numpy, the bundle's
runtime-only TVM and, when present, PyTorch. ``worker`` and ``tvm_slots`` import the testing
modules and the reference as siblings (``from .arrays import make_arrays``), as they sit in
``fuel_node/``: inside the repo those node modules are only ever run from a bundle (or a copy of
its ``fuel_node/``, ``deploy.node_code.node_module``), never as ``tvm_fuel.deploy.node.worker``;
the builder reads ``manifest`` and ``environment`` here too. Modules: ``main`` (the stages,
``run.py``), ``worker`` (one process running cases), ``manifest`` (its schema, checked before
anything runs), ``environment`` (the runtime, CUDA, the cubin store), ``tvm_slots`` (TVM's runtime
KV-cache slots, fuel's kernels against TVM's); beside them in the bundle ``arrays`` (seeded
inputs), ``compare`` (tolerances), ``peers`` (PyTorch's side) and ``reference``.
"""
