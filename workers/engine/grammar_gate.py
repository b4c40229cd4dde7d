"""Where constrained requests wait for their grammar: compiled on a thread pool, off the engine
loop, and cached per spec (`workers/sampling/grammar.py`); a request joins the scheduler's queue
once its grammar is ready, and fails (finish reason "error") if the grammar is invalid or not
ready within `GRAMMAR_WAIT_S`."""

from __future__ import annotations

from typing import Any

from workers.sampling.bad_words import bad_word_ids
from workers.sampling.constraint import Constraint
from workers.sampling.grammar import GrammarCompiler, vocab_tokenizer
from workers.sequence import Sequence


class GrammarGate:
    def __init__(self, tokenizer: Any, vocab: int, shards: int) -> None:
        self.tokenizer = tokenizer
        self.vocab = vocab  # the logits' width
        self.shards = shards  # compiled copies of each spec (`GrammarCompiler`)
        self.compiling: list[Sequence] = []
        self._compiler: GrammarCompiler | None = None  # made at the first structured output

    def constraint(self, params: Any) -> Constraint | None:
        """The token constraint of a request with sampling `params` (None: unconstrained);
        ValueError if `allowed_token_ids` allows nothing."""
        spec, allowed = params.structured_outputs, params.allowed_token_ids
        if spec is None and allowed is None and not params.bad_words:
            return None
        if allowed is not None and not any(t < self.vocab for t in allowed):
            raise ValueError("allowed_token_ids names no token of the vocabulary")
        compiled = None
        if spec is not None:
            if self._compiler is None:
                tokenizer, vocab = self.tokenizer, self.vocab
                self._compiler = GrammarCompiler(
                    lambda: vocab_tokenizer(tokenizer, vocab), shards=self.shards
                )
            compiled = self._compiler.submit(spec)
        words = bad_word_ids(self.tokenizer, params.bad_words)
        return Constraint(compiled, allowed, self.vocab, words)

    def holds(self, seq: Sequence) -> bool:
        """Whether `seq` must wait for its grammar (then it is held here)."""
        if seq.constraint is None or seq.constraint.poll() is True:
            return False
        self.compiling.append(seq)
        return True

    def drop(self, seq: Sequence) -> None:
        if seq in self.compiling:
            self.compiling.remove(seq)

    def ready(self, wait_s: float) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """The held sequences whose grammar is now ready, and those failed with the reason;
        first waiting up to `wait_s` for the oldest one's."""
        if wait_s > 0 and self.compiling:
            assert self.compiling[0].constraint is not None
            self.compiling[0].constraint.wait(wait_s)
        ready, failed = [], []
        for seq in list(self.compiling):
            assert seq.constraint is not None
            state = seq.constraint.poll()
            if state is False:
                continue
            self.compiling.remove(seq)
            if state is True:
                ready.append(seq)
            else:
                failed.append((seq, state))
        return ready, failed
