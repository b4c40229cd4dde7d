"""The model runner: one forward step over a batch of sequences, then sampling.

It owns the model, this rank's KV pool and the attention backend. Which tokens to compute is
the scheduler's business; the runner only turns (sequence, number of new tokens) pairs into
packed tensors, runs the model, and samples for the sequences whose last token was computed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from workers.attention import AttentionBatch, create_backend
from workers.config import EngineConfig
from workers.kvcache.pool import KVPool
from workers.model.loader import load_model, load_model_config, resolve_model
from workers.protocol import KVLayout
from workers.sampler import SampleResult, SamplingBatch, sample
from workers.sequence import Sequence
from workers.tp import SINGLE, TPGroup

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_GB = 1.0


@dataclass
class StepInput:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens of each sequence computed in this step

    def samples(self, i: int) -> bool:
        """Whether sequence i's step reaches its last token, so a next token is sampled."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


class ModelRunner:
    def __init__(self, cfg: EngineConfig, tp: TPGroup = SINGLE) -> None:
        self.cfg = cfg
        self.tp = tp
        self.device = cfg.resolved_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        self.dtype = cfg.resolved_dtype(self.device)
        self.model_dir = resolve_model(cfg.model)
        self.model_config = load_model_config(self.model_dir)
        self.model = load_model(self.model_dir, self.model_config, self.dtype, self.device, tp)
        attn = self.model.attention
        self.kv_layout = KVLayout(
            num_layers=self.model_config.num_layers,
            page_size=cfg.page_size,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            dtype=str(self.dtype).removeprefix("torch."),
            kv_head_offset=attn.qkv_proj.kv_head_offset,
        )
        self.pool = KVPool(self.kv_layout, self._num_pages(), self.device)
        self.attn = create_backend(
            cfg.resolved_backend(self.device), self.pool, attn.num_heads, attn.head_dim**-0.5
        )
        self.max_model_len = self._max_model_len()

    def _num_pages(self) -> int:
        if self.cfg.num_kv_pages is not None:
            return self.cfg.num_kv_pages
        if self.cfg.kv_cache_memory_gb is not None:
            budget = int(self.cfg.kv_cache_memory_gb * 2**30)
        elif self.device.type == "cpu":
            budget = int(CPU_DEFAULT_KV_GB * 2**30)
        else:
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - self.cfg.gpu_memory_utilization))
        pages = KVPool.pages_for_budget(self.kv_layout, budget)
        if pages < 2:
            raise ValueError(f"KV memory budget of {budget / 2**30:.2f} GiB holds no KV pages")
        return pages

    def _max_model_len(self) -> int:
        mc = self.model_config
        limit = mc.max_position_embeddings
        if mc.sliding_window is not None and mc.sliding_window < limit:
            logger.warning(
                "sliding-window attention is not implemented: context capped at %d",
                mc.sliding_window,
            )
            limit = mc.sliding_window
        if self.cfg.max_model_len is not None:
            if self.cfg.max_model_len > limit:
                raise ValueError(
                    f"max_model_len={self.cfg.max_model_len} exceeds the model's {limit}"
                )
            limit = self.cfg.max_model_len
        return limit

    @torch.inference_mode()
    def execute(self, step: StepInput) -> SampleResult | None:
        """Run one step; returns one sampled row per sequence for which `step.samples(i)`."""
        input_ids, positions, batch = self._prepare(step)
        self.attn.plan(batch)
        hidden = self.model(input_ids, positions, self.attn)
        rows = [i for i in range(len(step.seqs)) if step.samples(i)]
        if not rows:
            return None
        ends = torch.tensor(batch.q_lens, device=self.device).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[ends[rows]])
        return sample(logits, self._sampling_batch([step.seqs[i] for i in rows]))

    def _prepare(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        page_size = self.cfg.page_size
        ids: list[int] = []
        positions: list[int] = []
        for seq, n in zip(step.seqs, step.num_new_tokens):
            start = seq.num_computed_tokens
            ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
        kv_lens = [s.num_computed_tokens + n for s, n in zip(step.seqs, step.num_new_tokens)]
        max_pages = max(-(-kv // page_size) for kv in kv_lens)
        table = torch.zeros((len(step.seqs), max_pages), dtype=torch.int32)
        for row, (seq, kv) in enumerate(zip(step.seqs, kv_lens)):
            used = -(-kv // page_size)
            table[row, :used] = torch.tensor(seq.pages[:used], dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(
            torch.arange(len(step.seqs)), torch.tensor(step.num_new_tokens)
        )
        slot_pages = table[seq_of_token, pos // page_size].long()
        dev = self.device
        batch = AttentionBatch(
            q_lens=list(step.num_new_tokens),
            kv_lens=kv_lens,
            page_table=table.to(dev, non_blocking=True),
            slot_pages=slot_pages.to(dev, non_blocking=True),
            slot_offsets=(pos % page_size).to(dev, non_blocking=True),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
        return input_ids, pos.to(dev, non_blocking=True), batch

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        for seq in seqs:
            if seq.params.seed is not None and seq.generator is None:
                seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed % 2**64)
        params = [s.params for s in seqs]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        dev = self.device
        return SamplingBatch(
            temperatures=torch.tensor([p.temperature for p in params], device=dev),
            top_k=torch.tensor([p.top_k for p in params], device=dev),
            top_p=torch.tensor([p.top_p for p in params], device=dev),
            min_p=torch.tensor([p.min_p for p in params], device=dev),
            generators=[s.generator for s in seqs],
            num_logprobs=max(logprobs) if logprobs else -1,
        )
