"""A replica's own load signals for SLA autoscaling, as Serve polls them (its
`record_autoscaling_stats`).

Serve averages each signal per replica over the autoscaling look-back window and hands the
averages to the pool's policy (`cluster/autoscaling_policy.py`). Measured where the requests
pass, on the replica's side of the call, so they need nothing from the engine's step:
- `queued_prompt_tokens`: prompt tokens accepted and not yet through their first token;
- `arriving_tokens_per_s`: prompt tokens accepted per second since the last poll;
- `prefill_tokens_per_s`: prompt tokens finished per second while some were queued (what one
  replica computes when it has work; absent until measured);
- `ttft_ms`: mean time from a prompt's arrival to its first token, of those since the last poll;
- `tpot_ms`: time per output token of the streams since the last poll (stall included);
- `tpot_floor_ms`: the lowest time per output token seen while one stream ran alone (a step's
  fixed cost, what no number of replicas lowers; absent until seen);
- `kv_usage`, `seat_usage`: the engine's share of KV pages requests hold
  (`EngineStats.kv_pages_held`: the prefix cache's evictable pages count as free) and of batch
  seats taken.
A signal with nothing measured since the last poll is left out rather than reported as 0.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator

QUEUED_PROMPT_TOKENS = "queued_prompt_tokens"
ARRIVING_TOKENS_PER_S = "arriving_tokens_per_s"
PREFILL_TOKENS_PER_S = "prefill_tokens_per_s"
TTFT_MS = "ttft_ms"
TPOT_MS = "tpot_ms"
TPOT_FLOOR_MS = "tpot_floor_ms"
KV_USAGE = "kv_usage"
SEAT_USAGE = "seat_usage"

MIN_BUSY_S = 0.5  # a rate from less busy time than this is noise: keep the last one


class LoadMeter:
    """Counts what passes through one replica; `snapshot()` turns it into the signals above.
    Thread-safe: Serve may poll from another thread than the one serving requests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._queued = 0
        self._marked = clock()
        self._busy_s = 0.0  # seconds with queued prompt tokens, since start
        self._prefilled = 0  # prompt tokens through their first token, since start
        self._arrived, self._polled = 0, clock()  # prompt tokens accepted since the last poll
        self._rate_from = (0.0, 0)  # (busy_s, prefilled) where the next rate starts
        self._rate = 0.0
        self._ttft_s, self._ttft_n = 0.0, 0
        self._decode_s, self._decode_tokens = 0.0, 0.0
        self._streams = 0  # open output streams
        self._floor_s = math.inf  # seconds a token, the least seen with one stream

    def _mark(self) -> None:
        """Account the time since the last change (lock held): busy while tokens are queued."""
        now = self.clock()
        if self._queued > 0:
            self._busy_s += now - self._marked
        self._marked = now

    def admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self._mark()
            self._queued += prompt_tokens
            self._arrived += prompt_tokens

    def prefilled(self, prompt_tokens: int, ttft_s: float) -> None:
        with self._lock:
            self._mark()
            self._queued -= prompt_tokens
            self._prefilled += prompt_tokens
            self._ttft_s += ttft_s
            self._ttft_n += 1

    def dropped(self, prompt_tokens: int) -> None:
        """A prompt that left before its first token (failed or cancelled)."""
        with self._lock:
            self._mark()
            self._queued -= prompt_tokens

    def decoded(self, tokens: float, seconds: float, alone: bool = False) -> None:
        """`alone`: the only stream ran then, so the time is the floor's."""
        with self._lock:
            self._decode_tokens += tokens
            self._decode_s += seconds
            if alone and tokens:
                self._floor_s = min(self._floor_s, seconds / tokens)

    @contextlib.contextmanager
    def prefill(self, prompt_tokens: int) -> Iterator[None]:
        """Around a call that returns when the prompt's first token is out."""
        start = self.clock()
        self.admitted(prompt_tokens)
        try:
            yield
        except BaseException:
            self.dropped(prompt_tokens)
            raise
        self.prefilled(prompt_tokens, self.clock() - start)

    def _open(self, change: int) -> int:
        """Count a stream opened (+1) or closed (-1); the streams open now."""
        with self._lock:
            self._streams += change
            return self._streams

    def stream(self, prompt_tokens: int) -> StreamMeter:
        """A meter for one output stream; `prompt_tokens` 0 when its prompt was prefilled
        elsewhere (then every chunk is decode time)."""
        return StreamMeter(self, prompt_tokens)

    def snapshot(self, kv_usage: float, seat_usage: float) -> dict[str, float]:
        """The signals since the last snapshot (Serve's poll), with the engine's usage shares."""
        with self._lock:
            self._mark()
            signals = {QUEUED_PROMPT_TOKENS: float(max(0, self._queued)),
                       KV_USAGE: kv_usage, SEAT_USAGE: seat_usage}  # fmt: skip
            if self._marked > self._polled:
                signals[ARRIVING_TOKENS_PER_S] = self._arrived / (self._marked - self._polled)
                self._arrived, self._polled = 0, self._marked
            busy_s, prefilled = self._rate_from
            if self._busy_s - busy_s >= MIN_BUSY_S and self._prefilled > prefilled:
                self._rate = (self._prefilled - prefilled) / (self._busy_s - busy_s)
                self._rate_from = (self._busy_s, self._prefilled)
            if self._rate > 0:
                signals[PREFILL_TOKENS_PER_S] = self._rate
            if self._ttft_n:
                signals[TTFT_MS] = 1e3 * self._ttft_s / self._ttft_n
                self._ttft_s, self._ttft_n = 0.0, 0
            if self._decode_tokens:
                signals[TPOT_MS] = 1e3 * self._decode_s / self._decode_tokens
                self._decode_s, self._decode_tokens = 0.0, 0.0
            if self._floor_s < math.inf:
                signals[TPOT_FLOOR_MS] = 1e3 * self._floor_s
            return signals


class StreamMeter:
    """Times one output stream's chunks: the first is the prompt's first token when the stream
    prefills here, every other one decode time per token since the chunk before."""

    def __init__(self, meter: LoadMeter, prompt_tokens: int) -> None:
        self.meter = meter
        self.prompt_tokens = prompt_tokens
        self.last = meter.clock()
        self.open = True
        meter._open(+1)
        if prompt_tokens:
            meter.admitted(prompt_tokens)

    def chunk(self, tokens: int) -> None:
        now = self.meter.clock()
        if self.prompt_tokens:
            self.meter.prefilled(self.prompt_tokens, now - self.last)
            self.prompt_tokens = 0
        else:
            self.meter.decoded(tokens, now - self.last, alone=self.meter._open(0) == 1)
        self.last = now

    def close(self) -> None:
        """The stream ended: a prompt still queued never got its first token."""
        if self.prompt_tokens:
            self.meter.dropped(self.prompt_tokens)
            self.prompt_tokens = 0
        if self.open:
            self.open = False
            self.meter._open(-1)
