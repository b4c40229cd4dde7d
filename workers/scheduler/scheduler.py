"""Step scheduling: chunked prefill under a token budget, continuous batching, preemption.

Each step takes, in order: every running sequence (one token if it is decoding, the next chunk
of its prompt if it is still prefilling), then waiting sequences from the head of the queue,
while the step's token budget and the running-seat limit last. A long prompt is split across
steps; many prompts share one step. When a running sequence needs a page and none can be
freed, the newest running sequence is preempted: its computed pages go to the prefix cache,
it returns to the head of the queue, and it is recomputed later. Nothing is ever dropped.
Under the priority policy (`EngineConfig.scheduling_policy`) the queue is ordered by each
request's priority, then arrival, and the victim is the lowest-priority running sequence
(`waiting.py`).

With KV tiers, a waiting sequence whose prompt pages sit in host memory or on disk waits aside
(`loading`) while they are loaded, and rejoins the head of the queue when they are in; others
are scheduled meanwhile. A preempted sequence's pages then go down the tiers as the pool evicts
them (a swap to host memory) and come back the same way, instead of being recomputed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from workers.config import SchedulingPolicy
from workers.kvcache.manager import KVManager
from workers.scheduler.step import StepInput
from workers.scheduler.waiting import WaitingQueue, admission_key
from workers.sequence import SeqStatus, Sequence

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int, max_loras: int = 0,
        policy: SchedulingPolicy = "fcfs",
    ) -> None:  # fmt: skip
        self.kv = kv
        self.max_loras = max_loras  # distinct LoRA adapters in one step (0: LoRA is off)
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting = WaitingQueue(policy)
        self.running: list[Sequence] = []  # in admission order: the newest is last
        self.loading: dict[Sequence, None] = {}  # waiting for pages from the KV tiers
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of which swapped to the KV tiers, not recomputed

    def add(self, seq: Sequence) -> None:
        self.waiting.push(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues (finished or aborted); its pages are the caller's."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.loading:
            del self.loading[seq]
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def detach(self, seq: Sequence) -> None:
        """Take running `seq` out of the batch, keeping its pages (a prefill hand-off)."""
        self.running.remove(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join `seq`, whose KV is already in its pages, to the running batch (decode)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def schedule(self, preempt: bool = True) -> StepInput | None:
        """The next step. With `preempt` False (a step is still running, so sequences may hold
        tokens the host has not seen) a sequence that finds no free page waits a step instead."""
        step = StepInput(seqs=[], num_new_tokens=[])
        budget = self.budget
        loras: set[int] = set()  # the step's adapters
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens:
                continue  # its last token is still being sampled: nothing more to compute
            if not self._lora_fits(seq, loras):
                continue  # its adapter waits for a step with a free slot
            if len(seq.draft_ids) >= budget:  # the budget cuts its drafts
                del seq.draft_ids[budget - 1 :]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, n, step, preempt):
                continue
            step.seqs.append(seq)
            step.num_new_tokens.append(n)
            budget -= n
        loaded = [s for s in self.kv.finished_onloads() if s in self.loading]
        for seq in reversed(loaded):  # back to the head of the queue, in their order
            del self.loading[seq]
            self.waiting.push_back(seq)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.head()
            if not self._lora_fits(seq, loras):
                break  # FIFO: it waits for a slot of its adapter
            started = self.kv.start_onload(seq)
            if started is None:
                break  # its pages are below but no room to load them yet: FIFO, retry next step
            if started:
                self.loading[self.waiting.pop_head()] = None
                continue
            self.kv.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.kv.reserve(seq, seq.num_computed_tokens + n):
                self.kv.release(seq, cache=False)
                break  # no room: keep FIFO order, retry next step
            self.waiting.pop_head()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            step.seqs.append(seq)
            step.num_new_tokens.append(n)
            budget -= n
        if not step.seqs and self.loading and self.kv.tiers is not None:
            self.kv.tiers.wait(0.01)  # nothing to run until a load ends: do not spin
        return step if step.seqs else None

    def _lora_fits(self, seq: Sequence, loras: set[int]) -> bool:
        """Whether `seq`'s adapter joins the step's without passing max_loras (then noted)."""
        if seq.lora_id and seq.lora_id not in loras:
            if len(loras) >= self.max_loras:
                return False
            loras.add(seq.lora_id)
        return True

    def _reserve(self, seq: Sequence, n: int, step: StepInput, preempt: bool) -> bool:
        """Reserve pages for `seq`'s next `n` tokens, preempting newer sequences to make room
        (or, without `preempt`, giving up)."""
        while not self.kv.reserve(seq, seq.num_computed_tokens + n):
            if not preempt:
                return False
            victim = self._victim(step)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _victim(self, step: StepInput) -> Sequence | None:
        """The running sequence to preempt, of those not in `step` yet: the newest, or under
        the priority policy the one of lowest priority (the newest of those)."""
        free = [s for s in self.running if s not in step.seqs]
        if not free:
            return None
        return max(free, key=admission_key) if self.waiting.by_priority else free[-1]

    def _preempt(self, seq: Sequence | None) -> None:
        if seq is None:  # only sequences already in this step hold pages: cannot happen when
            raise RuntimeError("KV pool too small for a single sequence")  # admission checks
        how = "recomputation" if self.kv.tiers is None else "a swap to the KV tiers"
        logger.info("preempting %s (%d tokens) for %s", seq.request_id, seq.num_tokens, how)
        self.running.remove(seq)
        self.kv.release(seq, cache=True)  # only when no step is running: nothing is pending
        seq.draft_ids.clear()  # recomputed from its known tokens alone
        seq.status = SeqStatus.WAITING
        self.waiting.push_back(seq)
        self.num_preemptions += 1
        self.num_swap_preemptions += self.kv.tiers is not None

    def stats(self) -> dict[str, Any]:
        """`EngineStats`' scheduler counters, and the adapters of its running and waiting
        sequences (vLLM's `lora_requests_info`)."""

        def names(seqs: Iterable[Sequence]) -> list[str]:
            return sorted({s.lora.lora_name for s in seqs if s.lora is not None})

        return {
            "num_preemptions": self.num_preemptions,
            "num_swap_preemptions": self.num_swap_preemptions,
            "max_loras": self.max_loras,
            "lora_running": names(self.running),
            "lora_waiting": names([*self.waiting, *self.loading]),
        }

    def finished_step(self, step: StepInput) -> None:
        for seq, n in zip(step.seqs, step.num_new_tokens):
            seq.num_computed_tokens += n
