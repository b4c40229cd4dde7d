"""The model runner: one forward step over a batch of sequences, then sampling.

It owns the model, this rank's KV pool and the attention backend. Which tokens to compute is
the scheduler's business; the runner only turns (sequence, number of new tokens) pairs into
packed tensors, runs the model, and samples for the sequences whose last token was computed.

`launch()` queues a step on the device and returns at once, so the engine can prepare the next
step while this one runs. The next step may then compute a token the host has not seen yet:
the one this step samples. Such a token is taken from this step's output on the device.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.attention import AttentionBatch, create_backend
from workers.config import EngineConfig
from workers.engine.kv_budget import engine_kv_pages
from workers.engine.sampling_inputs import Masks, SamplingInputs
from workers.kernels.host_staging import to_device
from workers.kvcache.kv_dtype import kv_storage_dtype, pool_scales
from workers.kvcache.page_table import PageTable
from workers.kvcache.pool import KVPool
from workers.lora.manager import build_lora, lora_graph_mask, lora_step
from workers.model.blocked_weights import block_gate_up_weights
from workers.model.dummy import build_dummy_model
from workers.model.files import load_model_config, resolve_model
from workers.model.loader import load_model
from workers.parallel.group import SINGLE, TPGroup
from workers.protocol import KVLayout
from workers.sampling.penalties import adjusts_logits
from workers.sampling.sampler import (
    SampledTensors,
    SampleResult,
    SamplingBatch,
    argmax_rows,
    prompt_logprobs,
    sample,
)
from workers.scheduler.step import LaunchedStep, StepInput, StepOutputs, StepPlan
from workers.sequence import Sequence
from workers.spec.verify import verify_rows

if TYPE_CHECKING:
    from workers.engine.cuda_graph import DecodeCudaGraphs


PROMPT_ROWS_AT_ONCE = 512  # prompt-logprob rows per LM-head call


class ModelRunner:
    def __init__(self, cfg: EngineConfig, tp: TPGroup = SINGLE) -> None:
        self.cfg = cfg
        self.tp = tp
        self.device = cfg.resolved_device()
        self._allocated_before = 0  # this process's tensors before ours (other engines')
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
            self._allocated_before = torch.cuda.memory_allocated(self.device)
            from workers.kernels import pdl  # Triton: CUDA only

            pdl.allow(cfg.kernels.pdl)
        self.dtype = cfg.resolved_dtype(self.device)
        self.model_dir = resolve_model(cfg.model, cfg.load_format)
        self.model_config = load_model_config(self.model_dir).model_copy(
            update={"expert_parallel": cfg.expert_parallel}
        )
        if cfg.load_format == "dummy":
            self.model = build_dummy_model(
                self.model_config, self.dtype, self.device, tp, cfg.seed, cfg.kernels.fold_norms
            )
        else:
            self.model = load_model(
                self.model_dir, self.model_config, self.dtype, self.device, tp,
                cfg.kernels.fold_norms,
            )  # fmt: skip
        if cfg.kernels.blocked_weights:
            block_gate_up_weights(self.model)
        self.lora = build_lora(cfg, self.model, self.model_config, self._to_device)
        attn = self.model.attention
        kv_dtype = kv_storage_dtype(cfg.kv_cache_dtype, self.dtype)
        self.kv_layout = KVLayout(
            num_layers=self.model_config.num_layers,
            page_size=cfg.page_size,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            dtype=str(kv_dtype).removeprefix("torch."),
            kv_head_offset=attn.qkv_proj.kv_head_offset,
        )
        params = {p.data_ptr(): p for p in self.model.parameters()}.values()  # tied: once
        self.weight_bytes = sum(p.numel() * p.element_size() for p in params)
        self.max_model_len = self.model_config.context_limit(cfg.max_model_len)
        layers = self.model_config.num_layers
        scales = pool_scales(kv_dtype, self.model_dir, layers)
        self.pool = KVPool(self.kv_layout, self._num_pages(), self.device, self.dtype, scales)
        group = attn.num_heads // attn.num_kv_heads
        backend = cfg.resolved_backend(self.device, self.dtype, attn.head_dim, group)
        scale = attn.head_dim**-0.5
        tensor_cores = cfg.kernels.flashinfer_decode_tensor_cores
        self.attn = create_backend(backend, self.pool, attn.num_heads, scale, tensor_cores)
        self.page_table = PageTable()
        # The last launch's sampled ids on the device, and each sampling sequence's row in them.
        self._prev: tuple[torch.Tensor, dict[Sequence, int]] | None = None
        self._prev_launch: LaunchedStep | None = None  # its sampled ids, on their way to the host
        vocab = self.model_config.vocab_size
        self.sampling = SamplingInputs(self.device, vocab, self._to_device, cfg.grammar_threads)
        self.graphs: DecodeCudaGraphs | None = None
        graph_sizes = cfg.resolved_graph_batch_sizes()
        if graph_sizes and backend == "flashinfer" and self.device.type == "cuda":
            from workers.engine.cuda_graph import DecodeCudaGraphs  # CUDA only

            max_pages = -(-self.max_model_len // cfg.page_size)
            self.graphs = DecodeCudaGraphs(
                self.model, self.pool, attn.num_heads, scale, graph_sizes, max_pages, cfg.kernels,
                None if self.lora is None else self.lora.slots,
            )  # fmt: skip

    def _num_pages(self) -> int:
        layout, before = self.kv_layout, self._allocated_before
        return engine_kv_pages(self.cfg, layout.page_bytes, self.device, before, self.max_model_len)

    def execute(self, step: StepInput) -> SampleResult | None:
        """Run one step and wait for it: one sampled row per sequence for which
        `step.samples(i)`."""
        return self.launch(step).result()

    @torch.inference_mode()
    def launch(self, step: StepInput) -> LaunchedStep:
        """Queue one step on the device without waiting for it.

        Sampling decides on the host which filters run, so the host never waits for the device
        until `LaunchedStep.result()`.
        """
        if self._prev_launch is not None:
            self._prev_launch.finish()  # its sampled ids are this step's unseen tokens
        plan = self.plan(step)
        out = self.run_plan(plan)
        logits, greedy_ids, prompt = out.logits, out.greedy_ids, out.prompt
        prev, self._prev = self._prev, None
        prev_launch, self._prev_launch = self._prev_launch, None
        prompt_seqs = [(i, t) for i, t, _ in plan.prompt_targets]
        if logits is None:
            return LaunchedStep(step, plan.rows, None, prompt, prompt_seqs)
        seqs = [step.seqs[i] for i in plan.rows]
        drafts = None
        if any(s.draft_ids for s in seqs):  # a verify step: a sampling row per position
            self.sampling.ensure_generators(seqs)
            seqs, drafts = verify_rows(seqs)
        if all(
            s.params.temperature == 0
            and s.params.logprobs is None
            and not adjusts_logits(s.params)
            and not s.held_back_ids
            and s.constraint is None
            for s in seqs
        ):
            greedy = argmax_rows(logits) if greedy_ids is None else greedy_ids
            sampled: SampledTensors | partial[SampledTensors] = self._kept(
                SampledTensors(greedy), seqs
            )
        else:
            sb, masks = self.sampling.batch(seqs, prev, prev_launch)
            sb.drafts = None if drafts is None else (self._to_device(drafts), drafts)
            if masks is None:
                sampled = self._kept(sample(logits, sb), seqs)
            else:  # sampled at `finish()`: the host's work till then hides the fill
                sampled = partial(self._sample_masked, logits, sb, masks, seqs)
        launched = LaunchedStep(step, plan.rows, sampled, prompt, prompt_seqs)
        self._prev_launch = launched
        return launched

    @torch.inference_mode()
    def _sample_masked(
        self, logits: torch.Tensor, sb: SamplingBatch, masks: Masks, seqs: list[Sequence]
    ) -> SampledTensors:
        sb.mask = masks()
        return self._kept(sample(logits, sb), seqs)

    def _kept(self, sampled: SampledTensors, seqs: list[Sequence]) -> SampledTensors:
        """`sampled`, kept for the next launch: its unseen tokens come from these ids."""
        self._prev = (sampled.token_ids, {seq: r for r, seq in enumerate(seqs)})
        return sampled

    def plan(self, step: StepInput) -> StepPlan:
        """`step`'s inputs as host arrays, laid out for a CUDA graph where one applies."""
        token_rows, pad_to = self._graph_layout(step)
        plan = self.build_plan(step, token_rows, pad_to)
        plan.lora = None if self.lora is None else self.lora.assign(step.seqs, step.num_new_tokens)
        return plan

    def build_plan(self, step: StepInput, token_rows: bool, pad_to: int | None) -> StepPlan:
        """`step`'s inputs as host arrays. `token_rows`: every new token is a row of its own
        (one query attending to its sequence up to itself), so prefill chunks run as decode
        rows; `pad_to`: rows padded to that CUDA graph's batch size, a padding row being
        token 0 at position 0 with one KV token in slot 0 of scratch page 0."""
        page_size = self.cfg.page_size
        ids: list[int] = []
        row_seqs: list[Sequence] = []  # the sequence of each row
        q_lens: list[int] = []
        kv_lens: list[int] = []
        sample_rows: list[int] = []
        unseen: list[tuple[int, int]] = []  # (index in ids, row of the previous step's tokens)
        prompt_rows: list[int] = []
        prompt_targets: list[tuple[int, int, int]] = []
        prompt_top_n = 0
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_new_tokens)):
            start = seq.num_computed_tokens
            if seq.wants_prompt_logprobs:  # position t's logits give prompt token t + 1's
                for t in range(start, min(start + n, seq.num_prompt_tokens - 1)):
                    prompt_rows.append(len(ids) + t - start)
                    prompt_targets.append((i, t, seq.token_ids[t + 1]))
                    prompt_top_n = max(prompt_top_n, seq.params.prompt_logprobs or 0)
            known = seq.token_ids[start : start + n]
            if seq.draft_ids and len(known) < n:  # a verify step: the drafts follow
                known += seq.draft_ids[: n - len(known)]
            if len(known) < n:  # the last token is being sampled by the step still running
                assert self._prev is not None and len(known) == n - 1, "one unseen token at most"
                unseen.append((len(ids) + n - 1, self._prev[1][seq]))
                known.append(0)
            ids += known
            if token_rows:
                row_seqs += [seq] * n
                q_lens += [1] * n
                kv_lens += range(start + 1, start + n + 1)
            else:
                row_seqs.append(seq)
                q_lens.append(n)
                kv_lens.append(start + n)
            if step.samples(i):  # its last token's logits, and one per draft before it
                sample_rows += range(len(ids) - 1 - len(seq.draft_ids), len(ids))
        padding = 0 if pad_to is None else pad_to - len(q_lens)
        q_lens += [1] * padding
        kv_lens += [1] * padding
        ids += [0] * padding
        kv = np.asarray(kv_lens, dtype=np.int64)
        q = np.asarray(q_lens, dtype=np.int64)
        table = self.page_table.build(row_seqs, -(-kv // page_size))
        # Token t of row r sits at position kv_len - q_len + (t - first token of r).
        row_of_token = np.repeat(np.arange(len(q_lens)), q)
        first = np.cumsum(q) - q
        pos = (kv - q)[row_of_token] + np.arange(len(ids)) - first[row_of_token]
        packed = np.empty((4, len(ids)), dtype=np.int64)
        packed[0] = ids
        packed[1] = pos
        packed[2] = table[row_of_token, pos // page_size]
        packed[3] = pos % page_size
        return StepPlan(
            packed=packed,
            page_table=table,
            q_lens=q_lens,
            kv_lens=kv_lens,
            unseen=np.asarray(unseen, dtype=np.int64).reshape(-1, 2).T.copy(),
            rows=[i for i in range(len(step.seqs)) if step.samples(i)],
            sample_rows=sample_rows,
            graph=pad_to is not None,
            prompt_rows=prompt_rows,
            prompt_targets=prompt_targets,
            prompt_top_n=prompt_top_n,
        )

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> StepOutputs:
        """Queue the forward of `plan` on the device (every TP rank runs the same LM heads)."""
        input_ids, positions, batch = self.device_inputs(plan)
        rows = plan.sample_rows
        if plan.graph:  # never with prompt rows (`_graph_layout`)
            assert self.graphs is not None
            mask = lora_graph_mask(self.lora, plan.lora, len(plan.q_lens))
            logits, greedy_ids = self.graphs.run(input_ids, positions, batch, mask)
            if rows == list(range(len(rows))):
                return StepOutputs(logits[: len(rows)], greedy_ids[: len(rows)], None)
            index = self._to_device(np.asarray(rows, dtype=np.int64))
            return StepOutputs(logits[index], greedy_ids[index], None)
        self.attn.plan(batch)
        with lora_step(self.lora, plan.lora):
            hidden = self.model(input_ids, positions, self.attn)
        prompt = self._prompt_logprobs(hidden, plan) if plan.prompt_rows else None
        if not rows:
            return StepOutputs(None, None, prompt)
        if rows[-1] == len(rows) - 1:  # tokens 0..k-1: no gather needed
            last = hidden[: len(rows)]
        else:
            last = hidden[self._to_device(np.asarray(rows, dtype=np.int64))]
        return StepOutputs(self.model.compute_logits(last), None, prompt)

    def _prompt_logprobs(self, hidden: torch.Tensor, plan: StepPlan) -> SampledTensors:
        """The logprobs of the prompt tokens that `plan`'s prompt rows predict, through the LM
        head `PROMPT_ROWS_AT_ONCE` rows at a time: a long chunk's logits at once would take
        rows x vocab float32 (4 GiB for 8192 tokens of Llama-3's 128k)."""
        rows = self._to_device(np.asarray(plan.prompt_rows, np.int64))
        targets = self._to_device(np.asarray([t for *_, t in plan.prompt_targets], np.int64))
        parts = [
            prompt_logprobs(
                self.model.compute_logits(hidden[rows[i : i + PROMPT_ROWS_AT_ONCE]]),
                targets[i : i + PROMPT_ROWS_AT_ONCE],
                plan.prompt_top_n,
            )
            for i in range(0, len(plan.prompt_rows), PROMPT_ROWS_AT_ONCE)
        ]
        return SampledTensors.cat(parts)

    def device_inputs(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """Token ids, positions and the attention batch of `plan` on the device, in one to three
        pinned, non-blocking copies; unseen tokens come from the last launch's sampled ids."""
        packed = self._to_device(plan.packed)
        if plan.unseen.shape[1]:
            assert self._prev is not None
            where, rows = self._to_device(plan.unseen)
            packed[0][where] = self._prev[0][rows]
        batch = AttentionBatch(
            q_lens=plan.q_lens,
            kv_lens=plan.kv_lens,
            page_table=self._to_device(plan.page_table),
            slot_pages=packed[2],
            slot_offsets=packed[3],
        )
        return packed[0], packed[1], batch

    def _graph_layout(self, step: StepInput) -> tuple[bool, int | None]:
        """Whether `step` runs a row per token, and the captured size it pads to (None: eager).

        A decode step runs on the graph of its batch size. A step with prefill chunks of few
        tokens runs on the graph of its token count, one row per token: eagerly its ~10
        launches a layer take several times its GPU work on the host (docs/benchmarks.md, prefill).
        Rows of a chunk each read their sequence's KV up to themselves, so this is done only
        while those reads stay within as many bytes as the weights (read once a step). A step
        holding adapters runs on the size's LoRA graph, where there is one."""
        if self.graphs is None or step.scores_prompt():
            return False, None
        if not self.graphs.has_lora and any(s.lora for s in step.seqs):
            return False, None
        ps = self.cfg.page_size
        pairs = list(zip(step.seqs, step.num_new_tokens))
        max_pages = max(-(-(s.num_computed_tokens + n) // ps) for s, n in pairs)
        if all(n == 1 for n in step.num_new_tokens):
            return False, self.graphs.padded_size(len(step.seqs), max_pages)
        reads = sum(n * s.num_computed_tokens + n * (n + 1) // 2 for s, n in pairs if n > 1)
        if reads * self.kv_layout.page_bytes > self.weight_bytes * ps:  # KV tokens vs weights
            return False, None
        pad_to = self.graphs.padded_size(sum(step.num_new_tokens), max_pages, token_rows=True)
        return pad_to is not None, pad_to

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
