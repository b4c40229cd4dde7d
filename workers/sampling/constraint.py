"""A request's constraint on its next token: a grammar matcher (structured outputs), a static
set of allowed token ids and / or bad words (`bad_words.py`: tokens held back after what the
output ends with), and the batch's bitmask filled from them each step.

The matcher follows the request's output tokens by count (`sync`): it consumes the ones it has
not seen, and rolls back if the request kept fewer (it never does today: a preempted request
keeps its tokens and is recomputed), so it always matches the tokens the request holds, also
after a hand-off (the decode side's matcher consumes the prefill side's first token).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import numpy as np
import torch

from workers.sampling.bad_words import TokenSeqs, banned_after
from workers.sampling.token_mask import BITS, bitmask_words

GRAMMAR_WAIT_S = 30.0  # a request whose grammar is not compiled by then ends with an error


class Constraint:
    def __init__(
        self, compiled: Future[Any] | None, allowed: Sequence[int] | None, vocab: int,
        bad_words: TokenSeqs = (),
    ) -> None:  # fmt: skip
        self._compiled = compiled
        self.matcher: Any = None  # this request's copy, once compiled
        self.shard = 0  # which compiled matcher it copies (`GrammarCompiler`), by its id
        self.deadline = time.monotonic() + GRAMMAR_WAIT_S
        self.num_consumed = 0  # output tokens the matcher has consumed
        self.finished = False  # the grammar is complete: nothing but EOS may follow
        self.error: str | None = None
        self.static: np.ndarray | None = None  # int32 bitmask row of `allowed`
        if allowed is not None:
            bits = np.zeros(bitmask_words(vocab) * BITS, dtype=np.uint8)
            bits[[t for t in allowed if t < vocab]] = 1
            self.static = np.packbits(bits, bitorder="little").view(np.int32)
        # a word ending past the logits' width can never be sampled: nothing to hold back
        self.bad_words = tuple(seq for seq in bad_words if seq[-1] < vocab)
        self.banned = banned_after(self.bad_words, ())  # after `sync`'s output

    def poll(self) -> bool | str:
        """True once ready, False while compiling, or the error text if it cannot be used."""
        if self.matcher is not None or self._compiled is None:
            return True
        if not self._compiled.done():
            return "grammar compilation timed out" if time.monotonic() > self.deadline else False
        try:
            compiled = self._compiled.result()
        except ValueError as e:
            return str(e)
        self.matcher, self.shard = compiled.deep_copy(), id(compiled)
        self.refresh()
        return True

    def wait(self, timeout_s: float | None = None) -> bool | str:
        """`poll()` after waiting for the compilation up to `timeout_s` (None: the deadline)."""
        if self._compiled is not None and self.matcher is None:
            left = max(0.0, self.deadline - time.monotonic())
            with contextlib.suppress(TimeoutError):
                self._compiled.exception(timeout=left if timeout_s is None else timeout_s)
        return self.poll()

    def sync(self, output_ids: Sequence[int]) -> None:
        """Bring the matcher to `output_ids` (the request's output tokens, in order), and the
        bad words' held-back tokens after them."""
        if self.bad_words:
            self.banned = banned_after(self.bad_words, output_ids)
        n = len(output_ids)
        if self.matcher is None or n == self.num_consumed:
            return  # nothing to do: no call on a matcher that a fill may hold
        if n < self.num_consumed:
            self.matcher.rollback(self.num_consumed - n)
            self.num_consumed = n
        for token in output_ids[self.num_consumed :]:
            self.matcher.consume_token(token)  # an error state shows in `error` / the mask
        self.num_consumed = n
        self.refresh()

    def refresh(self) -> None:
        """Read the matcher's state into `finished` / `error`: they are read while a mask fill
        may hold the matcher (`MaskFiller`), when the matcher itself cannot be called."""
        self.finished = self.matcher is not None and self.matcher.is_stopped()
        failed = self.matcher is not None and self.matcher.is_error()
        self.error = f"grammar: {self.matcher.get_error()}" if failed else None


class MaskFiller:
    """Fills one bitmask row per constrained request and takes the bitmask to the device. The
    grammars' rows fill on a thread of their own, which runs without the GIL once `start` has
    handed it over, so the host goes on with the step's other work until `PendingMask.result`.
    On CUDA through two pinned buffers in turn, each reused once the copy out of it is done.

    Rows fill on `threads` threads, in order of the compiled matcher they copy (`shard`):
    copies of one share its lexer behind a lock, so threads working on rows of one shard would
    only contend for it (docs/notes/structured-outputs.md); llguidance's pool hands each
    thread a run of neighbouring rows."""

    def __init__(self, vocab: int, device: torch.device, threads: int) -> None:
        self.words = bitmask_words(vocab)
        self.device = device
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mask-fill")
        self._buffers = [torch.empty(0, self.words, dtype=torch.int32) for _ in range(2)]
        self._copied: list[Any] = [None, None]  # CUDA event after each buffer's last copy
        self._turn = 0

    def start(self, constraints: Sequence[Constraint]) -> PendingMask:
        """Begin filling `[len(constraints), words]`: no matcher may be called until the
        result is taken."""
        n, k = len(constraints), self._turn
        self._turn ^= 1
        if self._copied[k] is not None:
            self._copied[k].synchronize()
        if self._buffers[k].shape[0] < n:
            self._buffers[k] = torch.empty(max(n, 64), self.words, dtype=torch.int32,
                                           pin_memory=self.device.type == "cuda")  # fmt: skip
        mask = self._buffers[k][:n]
        mask.numpy().fill(-1)  # numpy's: torch's spreads 1 MiB over OpenMP threads that then spin
        rows = sorted((c.shard, i) for i, c in enumerate(constraints) if c.matcher is not None)
        grammars = [(constraints[i].matcher, i) for _, i in rows]
        # the executor itself, not llguidance.torch (whose import compiles a torch.compile
        # kernel's dependencies: ~4 s per process); `mask` rows are contiguous int32
        job = None
        if grammars:
            started = threading.Event()

            def fill() -> None:
                started.set()
                self._executor.unsafe_compute_mask_ptr(grammars, mask.data_ptr(), self.words * 4, n)

            job = self._thread.submit(fill)
            # Waiting here hands the GIL to the fill thread, which drops it inside llguidance:
            # otherwise it would start only when this thread next blocks (or after Python's 5 ms
            # switch interval), after the host work it is meant to run beside.
            started.wait()
        return PendingMask(self, k, mask, job, constraints)

    def to_device(self, k: int, mask: torch.Tensor) -> torch.Tensor:
        """`mask` (of buffer `k`) on the device, without waiting for the copy."""
        if self.device.type != "cuda":
            return mask.clone()
        on_device = mask.to(self.device, non_blocking=True)
        self._copied[k] = torch.cuda.Event()
        self._copied[k].record()
        return on_device


class PendingMask:
    """A bitmask being filled (`MaskFiller.start`)."""

    def __init__(
        self,
        filler: MaskFiller,
        k: int,
        mask: torch.Tensor,
        job: Future[None] | None,
        constraints: Sequence[Constraint],
    ) -> None:
        self._filler, self._k, self._mask, self._job = filler, k, mask, job
        self._constraints = constraints

    def result(self) -> torch.Tensor:
        """The filled bitmask on the device (its copy may still be under way)."""
        if self._job is not None:
            self._job.result()
        for i, c in enumerate(self._constraints):
            c.refresh()  # a fill can leave a matcher in an error state
            if c.static is not None:
                self._mask[i] &= torch.from_numpy(c.static)
            if c.banned:
                words = self._mask[i].numpy().view(np.uint32)
                for t in c.banned:
                    words[t // BITS] &= ~np.uint32(1 << (t % BITS))
        return self._filler.to_device(self._k, self._mask)
