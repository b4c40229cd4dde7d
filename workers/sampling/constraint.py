"""A request's constraint on its next token: a grammar matcher (structured outputs) and / or a
static set of allowed token ids, and the batch's bitmask filled from them each step.

The matcher follows the request's output tokens by count (`sync`): it consumes the ones it has
not seen, and rolls back if the request kept fewer (it never does today: a preempted request
keeps its tokens and is recomputed), so it always matches the tokens the request holds, also
after a hand-off (the decode side's matcher consumes the prefill side's first token).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import llguidance
import numpy as np
import torch

from workers.sampling.token_mask import BITS, bitmask_words

GRAMMAR_WAIT_S = 30.0  # a request whose grammar is not compiled by then ends with an error


class Constraint:
    def __init__(
        self, compiled: Future[Any] | None, allowed: Sequence[int] | None, vocab: int
    ) -> None:
        self._compiled = compiled
        self.matcher: Any = None  # this request's copy, once compiled
        self.deadline = time.monotonic() + GRAMMAR_WAIT_S
        self.num_consumed = 0  # output tokens the matcher has consumed
        self.static: np.ndarray | None = None  # int32 bitmask row of `allowed`
        if allowed is not None:
            bits = np.zeros(bitmask_words(vocab) * BITS, dtype=np.uint8)
            bits[[t for t in allowed if t < vocab]] = 1
            self.static = np.packbits(bits, bitorder="little").view(np.int32)

    def poll(self) -> bool | str:
        """True once ready, False while compiling, or the error text if it cannot be used."""
        if self.matcher is not None or self._compiled is None:
            return True
        if not self._compiled.done():
            return "grammar compilation timed out" if time.monotonic() > self.deadline else False
        try:
            self.matcher = self._compiled.result().deep_copy()
        except ValueError as e:
            return str(e)
        return True

    def wait(self, timeout_s: float | None = None) -> bool | str:
        """`poll()` after waiting for the compilation up to `timeout_s` (None: the deadline)."""
        if self._compiled is not None and self.matcher is None:
            left = max(0.0, self.deadline - time.monotonic())
            with contextlib.suppress(TimeoutError):
                self._compiled.exception(timeout=left if timeout_s is None else timeout_s)
        return self.poll()

    def sync(self, output_ids: Sequence[int]) -> None:
        """Bring the matcher to `output_ids` (the request's output tokens, in order)."""
        if self.matcher is None:
            return
        n = len(output_ids)
        if n < self.num_consumed:
            self.matcher.rollback(self.num_consumed - n)
            self.num_consumed = n
        for token in output_ids[self.num_consumed :]:
            self.matcher.consume_token(token)  # an error state shows in `error` / the mask
        self.num_consumed = n

    @property
    def finished(self) -> bool:
        """Whether the grammar is complete: nothing but EOS may follow."""
        return self.matcher is not None and self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        if self.matcher is not None and self.matcher.is_error():
            return f"grammar: {self.matcher.get_error()}"
        return None


class MaskFiller:
    """Fills one bitmask row per constrained request (the grammars' rows on llguidance's thread
    pool) and takes the bitmask to the device. On CUDA through two pinned buffers in turn, each
    reused once the copy out of it is done."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.words = bitmask_words(vocab)
        self.device = device
        self._executor = llguidance.LLExecutor()
        self._buffers = [torch.empty(0, self.words, dtype=torch.int32) for _ in range(2)]
        self._copied: list[Any] = [None, None]  # CUDA event after each buffer's last copy
        self._turn = 0

    def to_device(self, constraints: Sequence[Constraint]) -> torch.Tensor:
        """`[len(constraints), words]` int32 on the device, without waiting for the copy."""
        n, k = len(constraints), self._turn
        self._turn ^= 1
        cuda = self.device.type == "cuda"
        if self._copied[k] is not None:
            self._copied[k].synchronize()
        if self._buffers[k].shape[0] < n:
            self._buffers[k] = torch.empty(max(n, 64), self.words, dtype=torch.int32,
                                           pin_memory=cuda)  # fmt: skip
        mask = self._buffers[k][:n]
        mask.fill_(-1)
        grammars = [(c.matcher, i) for i, c in enumerate(constraints) if c.matcher is not None]
        if grammars:
            # the executor itself, not llguidance.torch (whose import compiles a torch.compile
            # kernel's dependencies: ~4 s per process); `mask` rows are contiguous int32
            self._executor.unsafe_compute_mask_ptr(grammars, mask.data_ptr(), self.words * 4, n)
        for i, c in enumerate(constraints):
            if c.static is not None:
                mask[i] &= torch.from_numpy(c.static)
        if not cuda:
            return mask.clone()
        on_device = mask.to(self.device, non_blocking=True)
        self._copied[k] = torch.cuda.Event()
        self._copied[k].record()
        return on_device
