"""Tensor parallelism: the group of ranks and the workers rank 0 starts (`group`), each worker's
loop (`worker`), and one step as the workers need it (`step`)."""
