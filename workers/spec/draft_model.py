"""Drafting with a small model of the target's vocabulary, greedily, in its own KV pool.

Each decoding sequence has a shadow here: a `Sequence` holding the same tokens, whose KV lives
in the draft's pages. A round of drafting first brings every shadow to its sequence (the tokens
accepted since the last round; at a sequence's first round its whole prompt and output, so in
disaggregated serving the decode side prefills the draft itself: the prompt's tokens are there
already, and the draft's KV, a fraction of the target's, is cheaper to compute than to ship),
then runs k - 1 one-token steps over all shadows at once. Greedy drafts are a deterministic
proposal, which rejection sampling against the target keeps exact for sampled requests too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from workers.kvcache.allocator import PageAllocator
from workers.kvcache.manager import KVManager
from workers.kvcache.pool import KVPool
from workers.protocol import SamplingParams
from workers.sampling.sampler import SampleResult
from workers.scheduler.step import StepInput
from workers.sequence import Sequence
from workers.spec.rollback import truncate_kv

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class DraftRunner(Protocol):
    """What drafting needs of a model runner (`ModelRunner`)."""

    pool: KVPool
    max_model_len: int

    def execute(self, step: StepInput) -> SampleResult | None: ...


@dataclass(eq=False)
class _Shadow:
    seq: Sequence  # in the draft's pool
    synced: int  # its leading tokens known to equal the target sequence's


class DraftModel:
    def __init__(self, runner: DraftRunner, page_size: int) -> None:
        self.runner = runner
        self.kv = KVManager(PageAllocator(runner.pool.num_pages), page_size, False)
        self._shadows: dict[Sequence, _Shadow] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to `ks[i]` greedy drafts after each of `seqs` (fewer where the draft's context or
        pool runs out)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        live = []  # (index in seqs, shadow, tokens its first step computes)
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k and len(seq.token_ids) + k <= self.runner.max_model_len:
                shadow = self._sync(seq)
                if self.kv.reserve(shadow, len(seq.token_ids) + k - 1):
                    live.append((i, shadow, shadow.num_uncomputed_tokens))
                else:
                    self.drop(seq)  # no room: this sequence is not drafted for now
        for depth in range(max((ks[i] for i, *_ in live), default=0)):
            live = [(i, s, n) for i, s, n in live if len(drafts[i]) < ks[i]]
            if not live:
                break
            step = StepInput([s for _, s, _ in live], [n if depth == 0 else 1 for *_, n in live])
            result = self.runner.execute(step)
            assert result is not None
            for (i, shadow, _), n, token in zip(live, step.num_new_tokens, result.token_ids):
                shadow.num_computed_tokens += n
                shadow.token_ids.append(token)
                drafts[i].append(token)
        return drafts

    def _sync(self, seq: Sequence) -> Sequence:
        """`seq`'s shadow holding `seq`'s tokens, its KV kept where its tokens agree."""
        shadow = self._shadows.get(seq)
        if shadow is None:
            shadow = _Shadow(Sequence(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens,
                                      GREEDY, None), len(seq.token_ids))  # fmt: skip
            self._shadows[seq] = shadow
        own, target = shadow.seq.token_ids, seq.token_ids
        same = shadow.synced
        while same < min(len(own), len(target)) and own[same] == target[same]:
            same += 1
        shadow.seq.token_ids = own[:same] + target[same:]
        shadow.synced = len(target)
        # the last token is computed again (its logits give the first draft) when the sequence
        # missed the step that verified the drafts
        computed = min(shadow.seq.num_computed_tokens, same, len(target) - 1)
        truncate_kv(self.kv, shadow.seq, computed)
        return shadow.seq

    def drop(self, seq: Sequence) -> None:
        """Free `seq`'s shadow's pages (it finished, or left this engine)."""
        shadow = self._shadows.pop(seq, None)
        if shadow is not None:
            self.kv.release(shadow.seq, cache=False)
