"""The engine: requests in, one scheduled model step at a time, token chunks out.

Synchronous and single-threaded on purpose: `LLM` drives it in a loop, and `AsyncEngine` runs the
same loop on a background thread for the Serve workers. A failure inside one step fails the
requests of that step with an error, never the engine.
"""

from __future__ import annotations

import logging
import time

from pydantic import BaseModel

from workers.config import EngineConfig
from workers.detokenizer import IncrementalDetokenizer
from workers.engine import ModelRunner
from workers.kvcache.allocator import PageAllocator
from workers.kvcache.manager import KVManager
from workers.model.loader import load_tokenizer
from workers.protocol import GenerateRequest, RequestOutput, TokenLogprob
from workers.sampler import SampleResult
from workers.scheduler.scheduler import Scheduler
from workers.sequence import SeqStatus, Sequence
from workers.tp import SINGLE, TPGroup

logger = logging.getLogger(__name__)


class RequestRejectedError(ValueError):
    """The request can never be served (too long for the context or the KV pool)."""


class EngineStats(BaseModel):
    num_running: int
    num_waiting: int
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_pinned: int
    kv_pages_cached: int = 0  # in the radix tree (used, but evictable unless pinned)
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_handoffs_pending: int = 0  # prefill: pinned prompts awaiting a reader; decode: reads
    nixl_bytes_transferred: int = 0  # decode: KV bytes read from prefill replicas
    nixl_transfers: int = 0
    nixl_xfer_time_s: float = 0.0
    kv_pages_read: int = 0  # decode: prompt pages read over NIXL ...
    kv_pages_reused: int = 0  # ... and found in this replica's prefix cache instead
    num_recomputed: int = 0  # decode: hand-offs that failed and were prefilled here
    prompt_tokens_computed: int
    generation_tokens: int


class Engine:
    def __init__(self, cfg: EngineConfig, tp: TPGroup = SINGLE) -> None:
        self.cfg = cfg
        self.runner = ModelRunner(cfg, tp)
        self.tokenizer = load_tokenizer(self.runner.model_dir)
        self.max_model_len = self.runner.max_model_len
        self.allocator = PageAllocator(self.runner.pool.num_pages)
        self.kv = KVManager(self.allocator, cfg.page_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        eos = set(self.runner.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.seqs: dict[str, Sequence] = {}
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0

    # ---- requests in -------------------------------------------------------------------------
    def add_request(self, req: GenerateRequest) -> Sequence:
        seq = self._new_sequence(req)
        self.scheduler.add(seq)
        return seq

    def _new_sequence(self, req: GenerateRequest) -> Sequence:
        """Check that `req` can be served at all, then track it (not yet scheduled)."""
        if req.request_id in self.seqs:
            raise RequestRejectedError(f"request id {req.request_id!r} is already running")
        n = len(req.prompt_token_ids)
        if n >= self.max_model_len:
            raise RequestRejectedError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {n} input tokens. Please reduce the length of the input."
            )
        if max(req.prompt_token_ids) >= self.runner.model_config.vocab_size:
            raise RequestRejectedError("prompt holds token ids outside the model's vocabulary")
        longest = min(n + req.params.max_tokens, self.max_model_len)
        pages = -(-longest // self.cfg.page_size)
        if pages > self.allocator.num_usable:
            raise RequestRejectedError(
                f"request needs up to {pages} KV pages; the pool holds {self.allocator.num_usable}"
            )
        seq = Sequence(
            request_id=req.request_id,
            token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=n,
            params=req.params,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                list(req.prompt_token_ids),
                req.params.skip_special_tokens,
                req.params.stop,
                req.params.include_stop_str_in_output,
            ),
        )
        self.seqs[req.request_id] = seq
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; None if it is unknown or already done."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
        return self._output(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if step is None:
            return []
        sampled_rows = [i for i in range(len(step.seqs)) if step.samples(i)]
        try:
            result = self.runner.execute(step)
        except Exception as e:  # noqa: BLE001 - fail the step's requests, keep the engine
            logger.exception("model step failed")
            return [self._fail(seq, f"{type(e).__name__}: {e}") for seq in step.seqs]
        self.scheduler.finished_step(step)
        for seq, n in zip(step.seqs, step.num_new_tokens):
            if n > 1:  # a prefill chunk: share its pages with requests that arrive meanwhile
                self.kv.cache_computed(seq)
        self.prompt_tokens_computed += sum(
            n for s, n in zip(step.seqs, step.num_new_tokens) if s.num_output_tokens == 0
        )
        outputs = []
        for row, i in enumerate(sampled_rows):
            seq = step.seqs[i]
            assert result is not None
            self._append_token(seq, result, row)
            outputs.append(self._after_token(seq))
        return outputs

    def _after_token(self, seq: Sequence) -> RequestOutput:
        """The chunk for `seq`'s new token; a finished sequence leaves and frees its pages."""
        out = self._output(seq)
        if seq.finished:
            self.seqs.pop(seq.request_id, None)
            self.scheduler.remove(seq)
        return out

    def _pinned_own_pages(self) -> int:
        """Pages outside the radix tree that are held for a hand-off (none here)."""
        return 0

    def _num_handoffs_pending(self) -> int:
        return 0

    def idle_wait_s(self) -> float:
        """How long the loop may sleep when there is nothing to step."""
        return 0.05

    def poll(self) -> list[RequestOutput]:
        """Background work between steps (KV hand-off notifications, transfers); none here."""
        return []

    def _append_token(self, seq: Sequence, result: SampleResult, row: int) -> None:
        token = result.token_ids[row]
        seq.token_ids.append(token)
        self.generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if result.logprobs is not None and seq.params.logprobs is not None:
            n = seq.params.logprobs
            top = {}
            if n and result.top_ids is not None and result.top_logprobs is not None:
                top = dict(zip(result.top_ids[row][:n], result.top_logprobs[row][:n]))
            seq.logprobs.append(TokenLogprob(token_id=token, logprob=result.logprobs[row], top=top))
        self._check_finish(seq, token)

    def _check_finish(self, seq: Sequence, token: int) -> None:
        p = seq.params
        may_stop = seq.num_output_tokens >= p.min_tokens
        assert seq.detokenizer is not None
        if may_stop and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif may_stop and not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif (stop := seq.detokenizer.add_token(token)) is not None and may_stop:
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.status = SeqStatus.FINISHED

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        self.seqs.pop(seq.request_id, None)
        self.scheduler.remove(seq, cache=False)  # this step's KV may be half-written
        seq.status, seq.finish_reason, seq.error = SeqStatus.FINISHED, "error", error
        return self._output(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        start, seq.num_emitted_tokens = seq.num_emitted_tokens, seq.num_output_tokens
        assert seq.detokenizer is not None
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=seq.output_token_ids[start:],
            text=seq.detokenizer.take_new_text(seq.finished),
            logprobs=seq.logprobs[start:] if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            error=seq.error,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_pages_total=self.allocator.num_usable,
            kv_pages_used=self.kv.num_used_pages,
            kv_pages_pinned=self.kv.num_pinned_pages + self._pinned_own_pages(),
            kv_pages_cached=0 if self.kv.radix is None else self.kv.radix.num_cached_pages,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_handoffs_pending=self._num_handoffs_pending(),
            prompt_tokens_computed=self.prompt_tokens_computed,
            generation_tokens=self.generation_tokens,
        )
