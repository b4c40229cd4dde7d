"""Every Triton kernel of the forward, and the launch options they share.

CUDA only; imported lazily by the code that calls them, so CPU machines never compile them.
`pdl` (programmatic dependent launch), `fused` (elementwise: norms, SiLU-and-mul), `rope`
(rotary embedding), `skinny_gemm` (GEMV/GEMM for a few rows: its dispatch; the kernels in
`skinny_gemv`, `skinny_dot`, `skinny_tiles`; launch configs per GPU in `tuning` and `tables/`),
`step_inputs` (a decode step's first kernel), `split_kv_decode` (batch-1 attention),
`fp8_decode` (decode attention over FP8 pages; both share `split_kv_common`),
`greedy_argmax`, `all_reduce` (the IPC all-reduce). `tuning`, `host_staging` (a step's host
arrays in page-locked memory allocated once, for their copies to the GPU), `weight_blocks`
(weights stored in blocks of rows, and F.linear over them) and `norms` (RMSNorm's dispatch,
Qwen3's q/k norms as the rotary kernels take them) import no Triton.
"""
