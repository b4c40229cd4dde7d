"""Faults injected on purpose (`EngineConfig.faults`), so failover tests cause each on demand.

The engine and its Serve worker call `Faults.strike` at the few points a fault can hit: a prompt
computed on a prefill replica, a decode replica's output tokens, a KV read, an engine step. An
engine configured without faults has `faults = None`: each hook costs one test of it.

Each replica counts its own matching events. A fault strikes at the `after`-th, once it has been
claimed in Ray's internal KV, so it hits at most `times` events across the cluster: the replica a
retry goes to, or the replacement Serve starts, is spared (outside Ray: per process). A step
fault that raises is sticky: the replica that claimed it is struck at every step from then on,
so its `times` counts replicas struck, as a device error that stays would strike them.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from workers.config import FaultConfig
from workers.ray_kv import ray_internal_kv

logger = logging.getLogger(__name__)

NAMESPACE = "pdserve-faults"


class Faults:
    def __init__(self, faults: Sequence[FaultConfig], role: str, tokenizer: Any) -> None:
        self.faults = [f for f in faults if f.role in (None, role)]
        self.tokenizer = tokenizer
        self.counts = [0] * len(self.faults)
        self.spent = [False] * len(self.faults)  # claimed `times` over: never strikes again
        self._local_claims = [0] * len(self.faults)
        self.held = [False] * len(self.faults)  # a sticky fault this replica claimed

    @classmethod
    def build(cls, faults: Sequence[FaultConfig], role: str, tokenizer: Any) -> Faults | None:
        return cls(faults, role, tokenizer) if faults else None

    def strike(
        self, point: str, prompt: Sequence[int] = (), num_tokens: int | None = None
    ) -> FaultConfig | None:
        """Count one event at `point` (for "decode_token": a request now holding `num_tokens`
        output tokens); the fault that hits it, if any. An "exit" fault ends the process here."""
        text: str | None = None
        for i, fault in enumerate(self.faults):
            if fault.point != point:
                continue
            if self.held[i]:
                return fault
            if self.spent[i]:
                continue
            if fault.prompt_contains is not None:
                if text is None:
                    text = self.tokenizer.decode(list(prompt))
                if fault.prompt_contains not in text:
                    continue
            if num_tokens is None:
                self.counts[i] += 1
            if (self.counts[i] if num_tokens is None else num_tokens) < fault.after:
                continue
            if not self._claim(i):
                self.spent[i] = True
                continue
            logger.warning("injected fault: %s at %s", fault.action, point)
            self.held[i] = fault.action == "raise"
            if fault.action == "exit":
                logging.shutdown()  # flush the line above: nothing runs after _exit
                os._exit(1)
            return fault
        return None

    def _claim(self, i: int) -> bool:
        """Take one of fault `i`'s `times` strikes; False when all are taken."""
        fault = self.faults[i]
        kv = ray_internal_kv()
        if kv is None:
            self._local_claims[i] += 1
            return self._local_claims[i] <= fault.times
        key = hashlib.sha1(fault.model_dump_json().encode()).hexdigest()[:16]
        for n in range(fault.times):
            if not kv._internal_kv_put(f"{key}/{n}", b"1", overwrite=False, namespace=NAMESPACE):
                return True  # the key was new: this strike is ours
        return False
