"""The engine's side of speculative decoding: drafts before a step is scheduled, acceptance and
rollback after it, and the counters vLLM exports (`spec_decode_*`).

Drafts go to decoding sequences only (their one uncomputed token is the last sampled one), at
most as many as the request's `max_tokens` and the context leave room for. A grammar-constrained
sequence keeps the drafts its grammar accepts. After the step, a sequence keeps its drafts up to
the first one the target did not produce, then the target's own token there (or, all accepted,
the bonus token after the last): 1 to k + 1 tokens a step.
"""

from __future__ import annotations

from typing import Any

from workers.config import SpeculativeConfig
from workers.kvcache.manager import KVManager
from workers.sequence import Sequence
from workers.spec.draft_model import DraftModel, DraftRunner
from workers.spec.ngram import TokenArrays, propose_ngram
from workers.spec.rollback import truncate_kv


class Speculator:
    def __init__(
        self,
        cfg: SpeculativeConfig,
        kv: KVManager,
        max_model_len: int,
        draft: DraftRunner | None = None,
    ) -> None:
        self.cfg = cfg
        self.kv = kv
        self.max_model_len = max_model_len
        self.draft = None if draft is None else DraftModel(draft, kv.page_size)
        self.token_arrays = TokenArrays()  # ngram's view of each sequence's tokens
        self.num_drafts = 0  # sequence-steps that verified drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * cfg.num_speculative_tokens

    def propose(self, running: list[Sequence]) -> None:
        """Set the drafts of every decoding sequence in `running` for the next step."""
        seqs, ks = [], []
        for seq in running:
            seq.draft_ids = []
            if seq.num_uncomputed_tokens != 1 or seq.num_output_tokens == 0:
                continue  # prefilling (or preempted and recomputing)
            room = min(
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - len(seq.token_ids),
            )
            k = min(self.cfg.num_speculative_tokens, room)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        if self.draft is not None:
            drafts = self.draft.propose(seqs, ks)
        else:
            c = self.cfg
            drafts = [
                propose_ngram(self.token_arrays.get(s), k, c.prompt_lookup_min, c.prompt_lookup_max)
                for s, k in zip(seqs, ks)
            ]
        for seq, proposed in zip(seqs, drafts):
            seq.draft_ids = _grammar_prefix(seq, proposed)

    def accept(self, seq: Sequence, tokens: list[int]) -> int:
        """How many of the verify step's `tokens` (one per position) `seq` keeps; counts them and
        clears the drafts."""
        drafts, seq.draft_ids = seq.draft_ids, []
        accepted = 0
        while accepted < len(drafts) and tokens[accepted] == drafts[accepted]:
            accepted += 1
        if drafts:
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            for pos in range(accepted):
                self.accepted_per_pos[pos] += 1
            seq.num_draft_tokens += len(drafts)
            seq.num_accepted_tokens += accepted
        return accepted + 1

    def rollback(self, seq: Sequence) -> None:
        """After `seq` took its tokens: its KV is valid up to its newest token (not included),
        which is the first one past the accepted drafts; pages past its tokens are freed."""
        truncate_kv(self.kv, seq, min(seq.num_computed_tokens, len(seq.token_ids) - 1))

    def drop(self, seq: Sequence) -> None:
        self.token_arrays.drop(seq)
        if self.draft is not None:
            self.draft.drop(seq)

    def stats(self) -> dict[str, Any]:
        """The `EngineStats` fields of speculation."""
        return dict(
            spec_num_drafts=self.num_drafts,
            spec_num_draft_tokens=self.num_draft_tokens,
            spec_num_accepted_tokens=self.num_accepted_tokens,
            spec_accepted_per_pos=list(self.accepted_per_pos),
        )


def _grammar_prefix(seq: Sequence, drafts: list[int]) -> list[int]:
    """The leading `drafts` that `seq`'s grammar accepts (all of them without a grammar)."""
    constraint = seq.constraint
    if not drafts or constraint is None or constraint.matcher is None:
        return drafts
    constraint.sync(seq.output_token_ids)
    return drafts[: constraint.matcher.validate_tokens(drafts)]
