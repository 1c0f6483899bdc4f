"""CUDA-only ops: RMSNorm, rotary and gate-and-multiply as Triton kernels."""
