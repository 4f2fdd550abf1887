"""Hand-written TensorIR schedules of the fuel kernels, per target (installed as ``tvm_fuel.schedules``).

The performance path (CPU and CUDA kernels that never materialize the [Sq, Sk] scores) lands
here; until then every fuel op runs its TE decomposition (``tvm_fuel.decompose``).
"""
