"""What a step is, on its way through the model runner: the scheduler's choice (`StepInput`),
its host arrays for every TP rank (`StepPlan`), what its forward leaves on the device
(`StepOutputs`) and the queued step whose results the engine waits for (`LaunchedStep`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from workers.protocol import LoRARequest
from workers.sampling.sampler import SampledTensors, SampleResult
from workers.sequence import Sequence


@dataclass
class StepInput:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens of each sequence computed in this step

    def samples(self, i: int) -> bool:
        """Whether sequence i's step reaches its last token (or draft), so a next token is
        sampled (after each draft too: the verify rows)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens + len(
            seq.draft_ids
        )

    def scores_prompt(self) -> bool:
        """Whether some sequence computes prompt tokens whose logprobs it wants."""
        return any(
            s.wants_prompt_logprobs and s.num_computed_tokens < s.num_prompt_tokens - 1
            for s in self.seqs
        )


@dataclass
class StepPlan:
    """One step's inputs as host arrays: what every tensor-parallel rank needs to run it."""

    packed: np.ndarray  # [4, tokens] int64: token ids, positions, KV slot pages, slot offsets
    page_table: np.ndarray  # [rows, pages] int32
    q_lens: list[int]  # per row (sequences, then CUDA-graph padding rows)
    kv_lens: list[int]
    unseen: np.ndarray  # [2, k] int64: index in the token ids, row of the last launch's ids
    rows: list[int]  # the sequences (indices into the step's) that sample a token
    # the tokens (indices into the token ids) whose logits are sampled: each sampling
    # sequence's last, preceded by one per draft it verifies
    sample_rows: list[int]
    graph: bool  # replay the CUDA graph of len(q_lens) rows
    # Prompt logprobs: tokens (indices into the token ids) whose logits give the logprob of the
    # prompt token after them, and for each (sequence index in the step, its position, that
    # next token).
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[tuple[int, int, int]] = field(default_factory=list)
    prompt_top_n: int = 0  # top logprobs per prompt token: the most any sequence asks
    # LoRA (`LoRAManager.assign`): the step's adapters with their device slots, and each
    # token's slot (-1: none); None for a step of base requests only (the graphs may run it)
    lora: tuple[list[tuple[int, LoRARequest]], np.ndarray] | None = None


@dataclass
class StepOutputs:
    """What a step's forward leaves on the device."""

    logits: torch.Tensor | None  # [sampled rows, vocab] float32; None if none samples
    greedy_ids: torch.Tensor | None  # their argmax, where a CUDA graph computed it
    prompt: SampledTensors | None  # logprobs of the plan's prompt rows' next tokens


class LaunchedStep:
    """A step queued on the device; `result()` waits for its sampled rows, `prompt_result()`
    for its prompt logprobs (`token_ids` there: the prompt tokens they are of).

    `sampled` may be a function that queues the sampling later (`finish()`): the model runner
    leaves it for after the host's other work when token masks are still being filled."""

    def __init__(
        self,
        step: StepInput,
        rows: list[int],
        sampled: SampledTensors | Callable[[], SampledTensors] | None,
        prompt: SampledTensors | None = None,
        prompt_seqs: list[tuple[int, int]] | None = None,
    ) -> None:
        self.step = step
        self.rows = rows  # indices into step.seqs of the sequences that sample a token
        # (index into step.seqs, position) of each prompt logprob: of the token after it
        self.prompt_seqs = prompt_seqs or []
        self._prompt_host = None if prompt is None else prompt.copy_to_host()
        self._host: SampledTensors | None = None
        self._done: torch.cuda.Event | None = None
        self._error: Exception | None = None
        self._deferred = sampled if callable(sampled) else None
        if not callable(sampled):
            self._queue(sampled, prompt)

    def finish(self) -> None:
        """Queue the sampling left for later, if any and not yet queued."""
        if self._deferred is None:
            return
        deferred, self._deferred = self._deferred, None
        try:
            self._queue(deferred(), None)
        except Exception as e:  # noqa: BLE001 - raised by result(), where the engine fails the step
            self._error = e

    def _queue(self, sampled: SampledTensors | None, prompt: SampledTensors | None) -> None:
        """Start the copies to the host; one event after them, and after any queued before."""
        self._host = None if sampled is None else sampled.copy_to_host()
        if any(t is not None and t.token_ids.is_cuda for t in (sampled, prompt)):
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> SampleResult | None:
        return self._wait(lambda: self._host)

    def prompt_result(self) -> SampleResult | None:
        return self._wait(lambda: self._prompt_host)

    def _wait(self, host: Callable[[], SampledTensors | None]) -> SampleResult | None:
        self.finish()
        if self._error is not None:
            raise self._error
        copied = host()
        if copied is None:
            return None
        if self._done is not None:
            self._done.synchronize()
        return copied.to_host()
