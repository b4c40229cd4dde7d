"""The base of both hand-off roles: an engine with a NIXL agent over its KV pool.

Protocol (pull, DESIGN.md "One request"):
1. The prefill engine computes the prompt, samples the first token and pins the prompt's pages
   under a lease; the first chunk carries a `KVHandle` naming them.
2. The decode engine allocates local pages for what its own prefix cache lacks and READs the rest
   from the prefill agent. NIXL delivers the lease id to the prefill agent when the read is done.
3. The prefill engine unpins on that notification, on `release_lease()`, or when the lease
   expires, whichever comes first. The decode engine trusts a read only if the pages' generation
   numbers, read after the data, still equal those in the handle (no free/reuse in between).
"""

from __future__ import annotations

import time
import uuid

from workers.config import EngineConfig, KVTransferConfig
from workers.disagg.faults import Faults
from workers.disagg.group_transfer import GroupTransfer
from workers.engine.engine import Engine, RequestRejectedError
from workers.engine.tp_runner import TPDriverRunner
from workers.parallel.group import SINGLE, TPGroup
from workers.protocol import GenerateRequest, KVLayout, RequestOutput
from workers.sequence import Sequence
from workers.transfer import KVTransferAgent


class HandoffEngine(Engine):
    """An engine with a NIXL agent over its KV pool: the common part of both sides.

    With tensor_parallel_size N > 1 every rank has its own agent over its own pool: rank 0's is
    `agent`, ranks 1..N-1's are driven through `group` (workers/disagg/group_transfer.py), and
    `agent_names` / `kv_layouts` list all N in rank order. At N == 1 `group` is None.
    """

    role: str

    def __init__(
        self,
        cfg: EngineConfig,
        transfer: KVTransferConfig,
        replica_tag: str | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__(cfg, tp)
        self.transfer = transfer
        tag = replica_tag or uuid.uuid4().hex[:8]
        device_copy = transfer.same_gpu == "auto"
        self.agent = KVTransferAgent(
            self.runner.pool, self.role, tag, tp.rank, device_copy=device_copy
        )
        self.group: GroupTransfer | None = None
        self.agent_names: list[str] = [self.agent.name]
        self.kv_layouts: list[KVLayout] = [self.agent.layout]
        if isinstance(self.runner, TPDriverRunner):
            self.group = GroupTransfer(self.runner, self.role, tag, device_copy)
            self.agent_names += self.group.agent_names
            self.kv_layouts += self.group.layouts
        self.faults = Faults.build(cfg.faults, self.role, self.tokenizer)

    def resume(self, req: GenerateRequest, first: RequestOutput) -> Sequence:
        """Admit a stream begun elsewhere whose engine failed: `first` (no KV handle) holds
        every token streamed so far. The prompt and those tokens are prefilled here, from the
        prefix cache where it can, and the request goes on from there."""
        if not first.token_ids:
            raise RequestRejectedError("a resumed request needs the tokens streamed so far")
        seq = self._continue(req, first)
        self._enqueue(seq)
        return seq

    def _continue(self, req: GenerateRequest, first: RequestOutput) -> Sequence:
        """A sequence for `req` that already holds `first`'s output tokens, as streamed: its
        detokenizer replays them (stop strings then match across the seam) and sends next only
        the text after `first.text`, which the other side held back."""
        seq = self._new_sequence(req)
        seq.token_ids += first.token_ids
        seq.num_emitted_tokens = len(first.token_ids)
        seq.logprobs = list(first.logprobs or [])  # keeps logprobs aligned with output tokens
        seq.num_cached_tokens = first.num_cached_tokens
        assert seq.detokenizer is not None
        for token in first.token_ids:  # none matched a stop string there, or it had ended
            seq.detokenizer.add_token(token, match_stop=False)
        seq.detokenizer.emitted = len(first.text)
        if seq.num_tokens >= self.max_model_len:
            self.seqs.pop(seq.request_id, None)
            raise RequestRejectedError("the prompt and its output already fill the context")
        return seq

    def _before_launch(self) -> None:
        if self.faults is not None and (fault := self.faults.strike("step")) is not None:
            if fault.action == "raise":  # as a sticky device error would, at every step
                raise RuntimeError("injected fault: the device fails every step")
            time.sleep(fault.delay_s)  # a stalled step: the loop thread does nothing meanwhile
