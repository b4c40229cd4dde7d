"""Tensor parallelism's plumbing: the TP group and its collectives, joining it, the rank actors,
and the one-shot IPC all-reduce for small messages between GPUs of one host."""
