"""Every Triton kernel of the forward, and the launch options they share.

CUDA only; imported lazily by the code that calls them, so CPU machines never compile them.
`pdl` (programmatic dependent launch), `fused` (elementwise: norms, rotary, SiLU-and-mul),
`skinny_gemm` (GEMV/GEMM for a few rows), `step_inputs` (a decode step's first kernel),
`split_kv_decode` (batch-1 attention), `greedy_argmax`, `all_reduce` (the IPC all-reduce).
"""
