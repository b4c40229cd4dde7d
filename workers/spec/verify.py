"""The sampling rows of a verify step: a sequence with k drafts samples at k + 1 positions.

Row j (0..k) is sampled as if the sequence already held its first j drafts: a view of the
sequence with those tokens appended, so everything that depends on the output so far (penalties,
`min_tokens`, a grammar's mask, logprobs) applies at each position as it would without drafts.
A view's grammar matcher is a copy of the sequence's, advanced over the drafts when its mask is
filled (`SamplingInputs`); the sequence's own matcher is never moved by a draft.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from workers.sequence import Sequence


def verify_rows(seqs: list[Sequence]) -> tuple[list[Sequence], np.ndarray]:
    """One view per sampled position of `seqs`, and each row's draft (-1 for a last row)."""
    views: list[Sequence] = []
    drafts: list[int] = []
    for seq in seqs:
        views += [seq, *(_view(seq, j) for j in range(1, len(seq.draft_ids) + 1))]
        drafts += [*seq.draft_ids, -1]
    return views, np.asarray(drafts, dtype=np.int64)


def _view(seq: Sequence, j: int) -> Sequence:
    """`seq` as if its first `j` drafts were its newest tokens (no drafts of its own)."""
    constraint = seq.constraint
    if constraint is not None:  # a view's own: its mask follows its own output
        constraint.sync(seq.output_token_ids)
        constraint = copy.copy(constraint)
        if constraint.matcher is not None:
            constraint.matcher = constraint.matcher.deep_copy()
    return dataclasses.replace(
        seq,
        token_ids=seq.token_ids + seq.draft_ids[:j],
        draft_ids=[],
        constraint=constraint,
    )
