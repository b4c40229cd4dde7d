"""CUDA graphs for decode steps: one captured model forward per batch size, replayed per step.

A graph holds the whole device side of a greedy decode step: the forward, the LM head (float32
logits) and the argmax. Other sampling reads the logits after the replay.

A decode step of n sequences runs the graph of the smallest captured size b >= n; so does a step
with prefill chunks of n new tokens in all, laid out one row per token (`ModelRunner.plan`): a
row is one query attending to its sequence up to itself, which is what decode attention does,
except in a graph whose attention is one launch per layer (`GraphDecodeAttention.split_kv`,
batch 1): there a row cannot see K/V that other rows write in the same launch, so such steps
take the next size up (`padded_size(token_rows=True)`). The runner pads the step to b rows
before it gets here: padding rows hold token 0 at position 0, write their K/V into slot 0 of
scratch page 0 and attend to that one token, so they touch no sequence's pages. Their outputs
are ignored.

Invariants a replay relies on:
- inputs live in static buffers (`input_ids`, `positions`, each size's slot buffers and page
  table metadata buffers) that are filled in place before `replay()`, never reallocated;
- the model's parameters and the KV pool keep their addresses for the runner's lifetime;
- all sizes share one memory pool and run on one stream, one at a time, so their intermediate
  tensors and FlashInfer's workspace may alias.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from workers.attention import xqa_decode
from workers.attention.base import AttentionBatch
from workers.attention.flashinfer import GraphDecodeAttention, new_workspace
from workers.attention.xqa_decode import XQABuffers
from workers.config import KernelConfig
from workers.kvcache.pool import KVPool
from workers.model.llama import LlamaForCausalLM
from workers.model.moe import reset_routed_token_counts
from workers.sampling.sampler import argmax_rows

logger = logging.getLogger(__name__)


class DecodeCudaGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        num_q_heads: int,
        scale: float,
        batch_sizes: tuple[int, ...],
        max_pages_per_seq: int,
        kernels: KernelConfig | None = None,
    ) -> None:
        """`kernels`: FlashInfer's decode on tensor cores, the FP8 decode kernel (defaults)."""
        if not batch_sizes:
            raise ValueError("no batch sizes to capture")
        self.model = model
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_pages_per_seq = max_pages_per_seq
        device = pool.pages.device
        max_bs = self.batch_sizes[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        workspace = new_workspace(device)
        indices = torch.zeros(max_bs * max_pages_per_seq, dtype=torch.int32, device=device)
        kernels = kernels or KernelConfig()
        layout = pool.layout
        xqa = None
        if pool.is_fp8 and xqa_decode.applies(layout.page_size, layout.head_dim, device):
            xqa = XQABuffers(max_bs, max_pages_per_seq, device)
        self.attn: dict[int, GraphDecodeAttention] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # logits, greedy ids
        mem_pool = torch.cuda.graph_pool_handle()
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        for bs in reversed(self.batch_sizes):  # largest first: smaller ones reuse its memory
            attn = GraphDecodeAttention(
                pool, num_q_heads, scale, bs, workspace, indices,
                kernels.flashinfer_decode_tensor_cores, xqa, kernels.fp8_decode_kernel,
            )  # fmt: skip
            self.attn[bs] = attn
            self._capture(bs, attn, mem_pool)
        reset_routed_token_counts(model)  # the warm-up forwards' routing is no traffic
        torch.cuda.synchronize(device)
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s (%.0f MiB)",
            self.batch_sizes,
            time.perf_counter() - start,
            (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20,
        )

    def padded_size(self, rows: int, max_pages: int, token_rows: bool = False) -> int | None:
        """The captured size a step of `rows` rows runs at, or None to run eagerly.
        `token_rows`: rows are tokens of prefill chunks (several may be one sequence's), which
        only graphs whose attention `accepts_token_rows` take."""
        if max_pages > self.max_pages_per_seq:
            return None
        for size in self.batch_sizes[bisect.bisect_left(self.batch_sizes, rows) :]:
            if not token_rows or self.attn[size].accepts_token_rows:
                return size
        return None

    def _dummy_batch(self, bs: int) -> AttentionBatch:
        device = self.input_ids.device
        zeros = torch.zeros(bs, dtype=torch.int64, device=device)
        return AttentionBatch(
            q_lens=[1] * bs,
            kv_lens=[1] * bs,
            page_table=torch.zeros((bs, 1), dtype=torch.int32, device=device),
            slot_pages=zeros,
            slot_offsets=zeros,
        )

    @torch.inference_mode()
    def _capture(self, bs: int, attn: GraphDecodeAttention, mem_pool: Any) -> None:
        attn.plan(self._dummy_batch(bs))
        ids, pos = self.input_ids[:bs], self.positions[:bs]
        for _ in range(2):  # warm-up: lazy initialisation and library handles stay out of the graph
            self._forward(ids, pos, attn)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mem_pool):
            self.outputs[bs] = self._forward(ids, pos, attn)
        self.graphs[bs] = graph

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, attn: GraphDecodeAttention
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.compute_logits(self.model(ids, pos, attn))
        return logits, argmax_rows(logits)

    def release(self) -> None:
        """Free the graphs. A TP group must do this before it destroys its NCCL communicator:
        a live graph holding the communicator's collectives makes the destroy wait forever
        (measured on two H200s; pytorch/pytorch#115388)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph of `len(batch.q_lens)` rows (a captured size); returns its logits
        `[rows, vocab]` and greedy ids `[rows]`, static buffers that the next replay of this
        size overwrites (in stream order: work queued before it still reads these values)."""
        bs = len(batch.q_lens)
        self.input_ids[:bs].copy_(input_ids, non_blocking=True)
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.attn[bs].plan(batch)
        self.graphs[bs].replay()
        return self.outputs[bs]
