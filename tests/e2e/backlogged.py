"""A stand-in prefill replica for the autoscaling test, in a module of its own: a replica
imports the module of its class, and this one imports no engine (torch, transformers)."""

from __future__ import annotations

from workers.serve.load_meter import PREFILL_TOKENS_PER_S, QUEUED_PROMPT_TOKENS


class Backlogged:
    """A prefill replica with 20k prompt tokens queued at 10k tokens/s: 2 s of work a replica
    against a 500 ms TTFT target, so the pool wants 4."""

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {QUEUED_PROMPT_TOKENS: 20_000.0, PREFILL_TOKENS_PER_S: 10_000.0}

    def __call__(self) -> str:
        return "ok"
