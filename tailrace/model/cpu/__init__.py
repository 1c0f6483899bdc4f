"""tailrace's C++ CPU kernels (csrc/) and their Python wrappers: packed and integer projections, elementwise ops, the one-call forward, huge pages, the per-op table."""
