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

With LoRA slots each size has a second graph, captured with the model's LoRA hooks on a static
one-hot slot mask (`lora_mask`, `workers/model/lora_layers.py`): a step holding adapters
replays it with its tokens' mask copied in, padding rows' mask rows zero (the base model alone).
A step of base requests only replays the base graph, which never reaches the hooks.

Invariants a replay relies on:
- inputs live in static buffers (`input_ids`, `positions`, `lora_mask`, each size's slot
  buffers and page table metadata buffers) that are filled in place before `replay()`, never
  reallocated;
- the model's parameters, the KV pool and the LoRA slots' A/B stacks (filled in place,
  `workers/lora/slots.py`) keep their addresses for the runner's lifetime;
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
from workers.attention.flashinfer import new_workspace
from workers.attention.graph_decode import GraphDecodeAttention
from workers.attention.xqa_decode import XQABuffers
from workers.config import KernelConfig
from workers.kvcache.pool import KVPool
from workers.lora.slots import LoRASlots
from workers.model.llama import LlamaForCausalLM
from workers.model.lora_layers import LoRAContext, LoRAStep
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
        lora: LoRASlots | None = None,
    ) -> None:
        """`kernels`: FlashInfer's decode on tensor cores, the FP8 decode kernel (defaults);
        `lora`: the model's LoRA slots, for a LoRA graph of each size besides the base one."""
        if not batch_sizes:
            raise ValueError("no batch sizes to capture")
        self.model = model
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_pages_per_seq = max_pages_per_seq
        device = pool.pages.device
        max_bs = self.batch_sizes[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.lora_mask: torch.Tensor | None = None  # [max_bs, slots]: each row's one-hot slot
        if lora is not None:
            self.lora_mask = torch.zeros(max_bs, lora.num_slots, dtype=lora.dtype, device=device)
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
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        mem_pool = torch.cuda.graph_pool_handle()
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        for bs in reversed(self.batch_sizes):  # largest first: smaller ones reuse its memory
            attn = GraphDecodeAttention(
                pool, num_q_heads, scale, bs, workspace, indices,
                kernels.flashinfer_decode_tensor_cores, xqa, kernels.fp8_decode_kernel,
            )  # fmt: skip
            self.attn[bs] = attn
            self.graphs[bs], self.outputs[bs] = self._capture(bs, attn, mem_pool)
            if lora is not None:
                self._capture_lora(bs, attn, mem_pool, lora.context)
        reset_routed_token_counts(model)  # the warm-up forwards' routing is no traffic
        torch.cuda.synchronize(device)
        logger.info(
            "captured decode CUDA graphs%s for batch sizes %s in %.1f s (%.0f MiB)",
            "" if lora is None else " with and without LoRA",
            self.batch_sizes,
            time.perf_counter() - start,
            (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20,
        )

    @property
    def has_lora(self) -> bool:
        """Whether steps holding adapters have graphs (`run`'s `lora_mask`)."""
        return bool(self.lora_graphs)

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
    def _capture(
        self, bs: int, attn: GraphDecodeAttention, mem_pool: Any
    ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
        """The graph of `bs` rows, with its logits and greedy ids."""
        attn.plan(self._dummy_batch(bs))
        ids, pos = self.input_ids[:bs], self.positions[:bs]
        for _ in range(2):  # warm-up: lazy initialisation and library handles stay out of the graph
            self._forward(ids, pos, attn)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mem_pool):
            outputs = self._forward(ids, pos, attn)
        return graph, outputs

    def _capture_lora(
        self, bs: int, attn: GraphDecodeAttention, mem_pool: Any, context: LoRAContext
    ) -> None:
        """The LoRA graph of `bs` rows: the model's hooks on the static mask's first rows."""
        assert self.lora_mask is not None
        context.step = LoRAStep(self.lora_mask[:bs])
        try:
            self.lora_graphs[bs], self.lora_outputs[bs] = self._capture(bs, attn, mem_pool)
        finally:
            context.step = None

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, attn: GraphDecodeAttention
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.compute_logits(self.model(ids, pos, attn))
        return logits, argmax_rows(logits)

    def release(self) -> None:
        """Free the graphs. A TP group must do this before it destroys its NCCL communicator:
        a live graph holding the communicator's collectives makes the destroy wait forever
        (measured on two H200s; pytorch/pytorch#115388)."""
        for graph in (*self.graphs.values(), *self.lora_graphs.values()):
            graph.reset()
        for by_size in (self.graphs, self.outputs, self.lora_graphs, self.lora_outputs):
            by_size.clear()

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        lora_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph of `len(batch.q_lens)` rows (a captured size); returns its logits
        `[rows, vocab]` and greedy ids `[rows]`, static buffers that the next replay of this
        graph overwrites (in stream order: work queued before it still reads these values).
        `lora_mask`: the one-hot slot mask of every row, padding rows zero
        (`LoRAManager.step_mask`), for the LoRA graph."""
        bs = len(batch.q_lens)
        self.input_ids[:bs].copy_(input_ids, non_blocking=True)
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.attn[bs].plan(batch)
        if lora_mask is None:
            self.graphs[bs].replay()
            return self.outputs[bs]
        assert self.lora_mask is not None, "no LoRA graphs captured"
        assert lora_mask.shape[0] == bs, "a mask row per graph row"
        self.lora_mask[:bs].copy_(lora_mask, non_blocking=True)
        self.lora_graphs[bs].replay()
        return self.lora_outputs[bs]
