"""The GPU kernels' fast paths (`EngineConfig.kernels`), a part of the engine's one schema."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class KernelConfig(BaseModel):
    """The GPU kernels' fast paths, each on by default (the fastest measured on an H200); turning
    one off keeps the results within rounding and serves comparisons or a platform that
    mishandles it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pdl: bool = Field(
        True,
        description="launch the Triton kernels with programmatic dependent launch (Hopper and "
        "newer): each starts loading its weights while the kernel before it ends. Off: for a "
        "comparison, or a driver that mishandles it",
    )
    fold_norms: bool = Field(
        True,
        description="on one rank, where the skinny GEMM runs every weight of a batch-1 decode "
        "step, fold the RMSNorm gains into the next weights at load: the GEMMs normalise their "
        "input and add the residual, no norm kernel runs. Off: keep the norm kernels (for a "
        "comparison)",
    )
    ipc_all_reduce: bool = Field(
        True,
        description="tensor parallel on CUDA: all-reduce small messages (and the norm after "
        "them) in one Triton kernel over the peers' memory (CUDA IPC, one host) instead of "
        "NCCL. Off: NCCL for every all-reduce (for a comparison)",
    )
    blocked_weights: bool = Field(
        False,
        description="store each layer's gate/up weight in blocks of 128 rows, each block "
        "transposed (workers/kernels/weight_blocks.py): the skinny GEMM then streams it in "
        "contiguous runs, 12% faster at 64 decode rows on an H200 (a 64 x 4096 FP8-KV step 8.69 "
        "against 8.96 ms); batch-1 steps read it with a GEMV over runs of a block's rows (on "
        "tensor cores, as before, they were ~5% slower; the GEMV is not yet measured against "
        "the row-major one) and prefill as a batched GEMM (1-9% slower for it). On for large "
        "decode batches; needs the gate/up rows of a rank divisible by 128",
    )
    lora_products: Literal["after", "beside", "epilogue"] = Field(
        "after",
        description="LoRA on CUDA, where a projection's adapter products run: after: the SGMV "
        "shrink and expand after its base GEMM, on one stream; beside: on a second stream "
        "beside the base GEMM, which reads the same rows, added after both (in gate/up's "
        "activation; o's and down's on the folded path with the next norm's sums of squares "
        "redone); epilogue: the shrink before the base GEMM "
        "and the expand in its epilogue, no launch after (decode steps on the folded path whose "
        "GEMMs run the skinny GEMM's tensor-core kernel, 9-64 tokens; elsewhere after)",
    )
    # A bool, not "on"/"off": YAML (config files, --set) reads those as booleans.
    flashinfer_decode_tensor_cores: bool | None = Field(
        None,
        description="FlashInfer's decode on tensor cores (its prefill kernels, each GQA group "
        "packed as query rows) or on its CUDA-core decode kernel; None: tensor cores for 4 or "
        "more query heads per KV head (faster on an H200 for Llama-3-8B), else CUDA cores",
    )
    fp8_decode_kernel: Literal["triton", "xqa"] | None = Field(
        None,
        description="decode graphs over an FP8 KV cache: 'triton' (fp16 tensor-core products, "
        "the FP8 values exact), 'xqa' (FlashInfer's XQA on Hopper: FP8 products, q and the "
        "probabilities cast to e4m3, ~17x the error on random data, 1.05-1.10x the KV read "
        "floor from 64 sequences up against 1.45x on an H200); None: per batch size, the "
        "faster one in the GPU's table (Triton where XQA does not apply or was not measured)",
    )
