"""Incremental detokenisation that never splits a UTF-8 character, and stop-string matching.

A token can end in the middle of a multi-byte character; its text then decodes to U+FFFD. We
re-decode a short window of recent tokens and only release text once it no longer ends in
U+FFFD; a sequence that ends inside a character releases it as U+FFFD, as a full decode
would. Stop strings are matched on the released text; the last `len(longest stop) - 1`
characters are held back while running, so a stop string is never streamed out before it is
recognised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Tokens of left context re-decoded with each new token: enough for the tokenizer to merge
# spaces and byte pieces the same way as a full decode.
CONTEXT_TOKENS = 5


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    prompt_ids: list[int]
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    text: str = ""  # all output text recognised so far (stop string cut off unless included)
    emitted: int = 0  # chars of `text` already handed out
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        self._ids = list(self.prompt_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int, match_stop: bool = True) -> str | None:
        """Append one output token; returns the matched stop string, if any. With `match_stop`
        False (the request's min_tokens not reached yet) stop strings are not looked for, so
        text that contains one stays whole."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        start = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._match_stop(start) if match_stop else None

    def _match_stop(self, new_from: int) -> str | None:
        if not self.stop:
            return None
        longest = max(len(s) for s in self.stop)
        window_start = max(0, new_from - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = self.text.find(s, window_start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        self.text = self.text[: pos + len(s)] if self.include_stop else self.text[:pos]
        return s

    def _flush(self) -> None:
        """Release the tokens still waiting for the rest of a character: a sequence that ended
        inside one keeps its bytes as U+FFFD, so its text is its token ids decoded (as vLLM's)."""
        if self._read_offset == len(self._ids):
            return
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out; while running, hold back a possible stop-string prefix (and
        the tokens of an incomplete character, released as U+FFFD once finished)."""
        if finished:
            self._flush()
        hold = 0 if finished or not self.stop else max(len(s) for s in self.stop) - 1
        end = max(self.emitted, len(self.text) - hold)
        chunk = self.text[self.emitted : end]
        self.emitted = end
        return chunk
