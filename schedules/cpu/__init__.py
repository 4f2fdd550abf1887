"""CPU (llvm) kernels of the performance path."""
