"""Attention over the KV cache: the slot slab and the reference, the paged cache with tailrace's CPU kernel, and the Triton kernel on CUDA."""
