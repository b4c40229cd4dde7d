"""The engine: requests in, one scheduled model step at a time, token chunks out.

Single-threaded on purpose: `LLM` drives it in a loop, and `AsyncEngine` runs the same loop on a
background thread for the Serve workers. A step that raises a request's error fails that step's
requests; anything else (a device error, a broken TP group) kills the engine: it aborts what it
holds and raises `EngineDeadError`, and refuses every request after with it.

With overlap scheduling (on by default on GPUs), `step()` schedules and launches step n+1 before
it waits for step n, so the host's work (scheduling, input preparation, attention plans, stop
checks, detokenising) runs while the device computes. Step n+1 then also computes one token for
each sequence that step n finishes; that token is dropped. A sequence that leaves while a step
that includes it is running keeps its pages until that step is done, because the step still
writes its KV there.
"""

from __future__ import annotations

import logging
import time
from typing import NoReturn

from workers.config import EngineConfig
from workers.engine.admission import (
    RequestRejectedError,
    check_pages,
    check_request,
    new_sequence,
)
from workers.engine.finish import check_finish, take_output, token_logprob
from workers.engine.grammar_gate import GrammarGate
from workers.engine.speculation import build_speculator
from workers.engine.step_tokens import StepCount, StepTokens
from workers.engine.tier_ranks import build_tiers
from workers.engine.tp_runner import create_runner, remove_lora
from workers.engine_stats import EngineDeadError, EngineStats
from workers.kvcache.allocator import PageAllocator
from workers.kvcache.manager import KVManager
from workers.lora.manager import lora_stats, request_adapter
from workers.model.files import load_tokenizer
from workers.model.moe import routed_token_counts
from workers.parallel.group import SINGLE, TPGroup
from workers.protocol import GenerateRequest, RequestOutput
from workers.sampling.sampler import SampleResult
from workers.scheduler.scheduler import Scheduler
from workers.scheduler.step import LaunchedStep, StepInput
from workers.sequence import SeqStatus, Sequence

logger = logging.getLogger(__name__)


class _RunningStep:
    """A launched step, and the sequences that left while it ran (pages freed after it)."""

    def __init__(self, launched: LaunchedStep) -> None:
        self.launched = launched
        self.seqs = set(launched.step.seqs)
        self.retired: list[tuple[Sequence, bool]] = []  # (sequence, cache its pages)


class Engine:
    supports_overlap = True  # False where a sampled token must be seen before the next step
    speculates = True  # False where no sequence decodes (a prefill pool)

    def __init__(self, cfg: EngineConfig, tp: TPGroup = SINGLE) -> None:
        self.cfg = cfg
        self.runner = create_runner(cfg, tp)  # rank 0 of a group when tensor_parallel_size > 1
        self.tokenizer = load_tokenizer(self.runner.model_dir)
        self.max_model_len = self.runner.max_model_len
        self.allocator = PageAllocator(self.runner.pool.num_pages)
        tiers = build_tiers(self.runner, cfg)
        self.kv = KVManager(self.allocator, cfg.page_size, cfg.enable_prefix_caching, tiers)
        limits = (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_loras * cfg.enable_lora)
        self.scheduler = Scheduler(self.kv, *limits, cfg.scheduling_policy)
        eos = {*self.runner.model_config.eos_token_ids, self.tokenizer.eos_token_id} - {None}
        self.eos_token_ids = frozenset(eos)
        self.seqs: dict[str, Sequence] = {}
        vocab = self.runner.model_config.vocab_size
        self.grammars = GrammarGate(self.tokenizer, vocab, cfg.grammar_threads)
        self.overlap = self.supports_overlap and cfg.resolved_overlap(self.runner.device)
        self._running: _RunningStep | None = None
        self._prev: _RunningStep | None = None  # the step being completed
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self.step_tokens = StepTokens()
        self.spec = build_speculator(cfg, self.runner, self.kv) if self.speculates else None
        self.dead: EngineDeadError | None = None  # set when a step kills the engine

    # ---- requests in -------------------------------------------------------------------------
    def add_request(self, req: GenerateRequest) -> Sequence:
        seq = self._new_sequence(req)
        self._enqueue(seq)
        return seq

    def _enqueue(self, seq: Sequence) -> None:
        """Queue `seq` for the scheduler, or for its grammar first (`GrammarGate`)."""
        if not self.grammars.holds(seq):
            self.scheduler.add(seq)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the sequences whose grammar is ready, fail those whose grammar cannot be used;
        with nothing else to do, wait a little for one rather than spin."""
        idle = not self.scheduler.has_work() and self._running is None
        ready, failed = self.grammars.ready(self.idle_wait_s() if idle else 0.0)
        for seq in ready:
            self.scheduler.add(seq)
        return [self._fail(seq, why) for seq, why in failed]

    def _new_sequence(self, req: GenerateRequest) -> Sequence:
        """Check that `req` can be served at all, then track it (not yet scheduled)."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        if req.request_id in self.seqs:
            raise RequestRejectedError(f"request id {req.request_id!r} is already running")
        check_request(req, self.cfg.scheduling_policy, self.max_model_len,
                      self.runner.model_config.vocab_size)  # fmt: skip
        try:
            constraint = self.grammars.constraint(req.params)
            lora = request_adapter(self.runner.lora, req.lora)  # a bad adapter fails it now
        except ValueError as e:
            raise RequestRejectedError(str(e)) from e
        check_pages(req, self.max_model_len, self.cfg.page_size, self.allocator.num_usable)
        seq = new_sequence(req, self.tokenizer, self.eos_token_ids, constraint, lora)
        self.seqs[req.request_id] = seq
        return seq

    def remove_lora(self, lora_int_id: int) -> bool:
        self.kv.drop_lora(lora_int_id)  # unloaded: its prefix-cache pages, host copy, slot
        return remove_lora(self.runner, lora_int_id)  # on every TP rank

    def lora_ids_in_use(self) -> set[int]:
        """The adapters of requests whose pages are held here: an unload waits for them."""
        running = () if self._running is None else self._running.seqs  # those that left too
        return {s.lora_id for s in (*self.seqs.values(), *running) if s.lora_id}

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; None if it is unknown or already done."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self._retire(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
        return self._output(seq)

    def _retire(self, seq: Sequence, cache: bool = True) -> None:
        """Take `seq` out of the queues and free its pages, once no running step writes them."""
        self.grammars.drop(seq)
        self.scheduler.remove(seq)
        if self.spec is not None:
            self.spec.drop(seq)
        if self._running is not None and seq in self._running.seqs:
            self._running.retired.append((seq, cache))
        else:
            self.kv.release(seq, cache=cache)

    def has_work(self) -> bool:
        busy = self.scheduler.has_work() or self._running is not None
        return busy or bool(self.grammars.compiling)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next step, then finish the one launched by the previous call (overlap),
        or launch and finish one step (no overlap). Returns the finished step's chunks; raises
        `EngineDeadError` if the step kills the engine."""
        outputs = self._admit_compiled() if self.grammars.compiling else []
        prev = self._prev = self._running  # completed below, or freed by `_die`
        self._running = None
        if self.spec is not None:  # never with overlap: `prev` is None
            self.spec.propose(self.scheduler.running)
        step = self.scheduler.schedule(preempt=prev is None)
        if step is not None:
            self._launch(step, outputs)
        if prev is not None:
            outputs += self._complete(prev)
        if not self.overlap and self._running is not None:
            current, self._running = self._running, None
            outputs += self._complete(current)
        return outputs

    def _launch(self, step: StepInput, outputs: list[RequestOutput]) -> None:
        try:
            self._before_launch()
            launched = self.runner.launch(step)
        except RequestRejectedError as e:  # a request's error: fail the step's requests
            logger.exception("model step failed")
            outputs += [self._fail(seq, f"{type(e).__name__}: {e}") for seq in step.seqs]
            return
        except Exception as e:
            self._die(e)
        self._running = _RunningStep(launched)
        for seq, n in zip(step.seqs, step.num_new_tokens):
            prompt_left = max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
            self.prompt_tokens_computed += min(n, prompt_left)
        self.scheduler.finished_step(step)
        for seq, n in zip(step.seqs, step.num_new_tokens):
            if n > 1:  # a prefill chunk: share its pages with requests that arrive meanwhile
                self.kv.cache_computed(seq)
        for i in launched.rows:
            step.seqs[i].num_pending_tokens += 1

    def _complete(self, running: _RunningStep) -> list[RequestOutput]:
        """Wait for `running`, append its tokens, free the pages of sequences that left."""
        launched, self._prev = running.launched, running
        seqs = [launched.step.seqs[i] for i in launched.rows]
        outputs = []
        try:
            prompt = launched.prompt_result()
            result = launched.result()
        except RequestRejectedError as e:  # a request's error: fail the step's requests
            logger.exception("model step failed")
            for seq in seqs:
                seq.num_pending_tokens -= 1
            outputs = [self._fail(s, f"{type(e).__name__}: {e}") for s in seqs if self._alive(s)]
            prompt = result = None
        except Exception as e:
            self._die(e)
        if prompt is not None:  # before the sampled tokens: the first output carries them
            for row, (i, position) in enumerate(launched.prompt_seqs):
                seq = launched.step.seqs[i]
                # in order; a prompt recomputed after preemption has them already
                if self._alive(seq) and position + 1 == len(seq.prompt_logprobs):
                    n = seq.params.prompt_logprobs or 0
                    seq.prompt_logprobs.append(token_logprob(prompt, row, n))
        if result is not None:
            row = 0  # a sequence's rows: one, or one per position of a verify step
            counted = StepCount()
            for seq in seqs:
                seq.num_pending_tokens -= 1
                rows = 1 + len(seq.draft_ids)
                if self._alive(seq):  # else it left while this token was computed: drop it
                    with counted.tokens_of(seq):
                        self._append_tokens(seq, result, row, rows)
                    outputs.append(self._after_token(seq))
                row += rows
            if counted.sequences:
                self.step_tokens.observe(counted.tokens)
        self._free_retired(running)
        return outputs

    def _free_retired(self, running: _RunningStep | None) -> None:
        """Free the pages of the sequences that left while `running` ran (it is over)."""
        while running is not None and running.retired:
            seq, cache = running.retired.pop(0)
            self.kv.release(seq, cache=cache)

    def _before_launch(self) -> None:
        """Runs in each step's launch, where a device error would raise: a fault's hook."""

    def _die(self, e: Exception) -> NoReturn:
        """A step raised `e`, not a request's error: the engine serves nothing more. Abort what
        it holds (no step will write those pages now) and raise `EngineDeadError` from `e`."""
        logger.error("model step failed: the engine is dead", exc_info=e)
        self.dead = EngineDeadError(f"the engine died: {type(e).__name__}: {e}")
        for running in (self._prev, self._running):
            self._free_retired(running)
        self._running = None
        for rid in list(self.seqs):
            self.abort(rid)
        raise self.dead from e

    def _alive(self, seq: Sequence) -> bool:
        return not seq.finished and self.seqs.get(seq.request_id) is seq

    def _after_token(self, seq: Sequence) -> RequestOutput:
        """The chunk for `seq`'s new token; a finished sequence leaves and frees its pages."""
        out = self._output(seq)
        if seq.finished:
            self.seqs.pop(seq.request_id, None)
            self._retire(seq)
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

    def _append_tokens(self, seq: Sequence, result: SampleResult, row: int, rows: int) -> None:
        """Append `seq`'s token from `result`'s `row`; from a verify step's `rows` rows, its
        accepted drafts and the token after them, up to one that ends it."""
        if self.spec is None:
            self._append_token(seq, result, row)
            return
        keep = self.spec.accept(seq, result.token_ids[row : row + rows])
        for r in range(row, row + keep):
            self._append_token(seq, result, r)
            if seq.finished:
                break
        self.spec.rollback(seq)

    def _append_token(self, seq: Sequence, result: SampleResult, row: int) -> None:
        token = result.token_ids[row]
        seq.token_ids.append(token)
        self.generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if result.logprobs is not None and seq.params.logprobs is not None:
            seq.logprobs.append(token_logprob(result, row, seq.params.logprobs))
        check_finish(seq, token, self.max_model_len)

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        self.seqs.pop(seq.request_id, None)
        self._retire(seq, cache=False)  # this step's KV may be half-written
        seq.status, seq.finish_reason, seq.error = SeqStatus.FINISHED, "error", error
        return self._output(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        return take_output(seq)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.grammars.compiling),
            kv_pages_total=self.allocator.num_usable,
            kv_pages_used=self.kv.num_used_pages,
            kv_pages_pinned=self.kv.num_pinned_pages + self._pinned_own_pages(),
            kv_pages_cached=0 if self.kv.radix is None else self.kv.radix.num_cached_pages,
            kv_pages_evictable=0 if self.kv.radix is None else self.kv.radix.num_evictable_pages,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            **self.scheduler.stats(),
            num_handoffs_pending=self._num_handoffs_pending(),
            prompt_tokens_computed=self.prompt_tokens_computed,
            generation_tokens=self.generation_tokens,
            iteration_tokens=list(self.step_tokens.buckets),
            iteration_tokens_sum=self.step_tokens.sum,
            engine_deaths={} if self.dead is None else {type(self.dead.__cause__).__name__: 1},
            moe_expert_tokens=routed_token_counts(self.runner.model),
            **lora_stats(self.runner.lora),
            **({} if self.spec is None else self.spec.stats()),
            **({} if self.kv.tiers is None else self.kv.tiers.stats()),
        )
