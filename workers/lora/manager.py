"""Which adapters a rank holds: a host cache of loaded adapters (least recently used dropped
past `max_cpu_loras`), the device slots (`max_loras`), and each step's tokens' slots.

Rank 0 picks the slots (`assign`, when planning a step) and the plan carries them; every rank
fills a slot from its own host cache, loading the adapter's files on a miss (`step_mask`). The
step's one-hot slot mask goes to the model's hooks for an eager forward (`running`), or to the
LoRA graph of its size (`DecodeCudaGraphs.run`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np
import torch

from workers.config import EngineConfig
from workers.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from workers.lora.slots import LoRASlots
from workers.model.config import ModelConfig
from workers.model.llama import LlamaForCausalLM
from workers.model.lora_layers import LoRAStep
from workers.protocol import LoRARequest
from workers.sequence import Sequence

logger = logging.getLogger(__name__)

NO_ADAPTER = -1  # a token's slot when it runs with the base model alone
# A step's adapters with their slots, and each of its tokens' slot (`LoRAManager.assign`).
StepLoRA = tuple[list[tuple[int, LoRARequest]], np.ndarray]


class LoRAManager:
    def __init__(
        self, cfg: EngineConfig, model: LlamaForCausalLM, model_config: ModelConfig,
        to_device: Callable[[np.ndarray], torch.Tensor],
    ) -> None:  # fmt: skip
        self.model_config = model_config
        self.max_rank = cfg.max_lora_rank
        self.max_cpu = cfg.max_cpu_loras or cfg.max_loras
        products = cfg.kernels.lora_products
        self.slots = LoRASlots(model, cfg.max_loras, cfg.max_lora_rank, products)
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # by lora_int_id, LRU first
        # every adapter taken and not removed, though LRU dropped its copies: its pages may stay
        self.taken: dict[int, LoRARequest] = {}
        self.resident: list[LoRARequest | None] = [None] * cfg.max_loras  # each slot's adapter
        self._slot_use: list[int] = [0] * cfg.max_loras  # the step that last used each slot
        self._steps = 0
        self._to_device = to_device

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """`request`'s adapter from the host cache, loaded (and checked) on a miss."""
        found = self.host.get(request.lora_int_id)
        if found is not None and found.request == request:
            self.host.move_to_end(request.lora_int_id)
            return found
        adapter = load_adapter(request, self.model_config, self.max_rank)
        self.slots.check(adapter)
        if found is not None:  # an id reused for other files: drop the old one
            self.remove(request.lora_int_id)
        self.host[request.lora_int_id] = adapter
        self.taken[request.lora_int_id] = request
        while len(self.host) > self.max_cpu:
            old, _ = self.host.popitem(last=False)
            logger.info("LoRA host cache full: dropped adapter %d", old)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (unloaded): its host copy and its device slot. Whether it was held."""
        held = self.host.pop(lora_int_id, None) is not None
        self.taken.pop(lora_int_id, None)
        for slot, owner in enumerate(self.resident):
            if owner is not None and owner.lora_int_id == lora_int_id:
                self.resident[slot] = None
                self.slots.clear(slot)
                held = True
        return held

    def assign(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepLoRA | None:
        """Slots for a step's distinct adapters (at most max_loras: the scheduler's cap), and
        each of its tokens' slot (NO_ADAPTER for base requests'), the sequences' tokens in
        order; None for a step without adapters. Resident adapters keep their slots, the others
        take free or least recently used ones."""
        wanted = {s.lora.lora_int_id: s.lora for s in seqs if s.lora is not None}
        if not wanted:
            return None
        self._steps += 1
        taken = {s for s, owner in enumerate(self.resident) if owner in wanted.values()}
        out = []
        for request in wanted.values():
            if request in self.resident:
                slot = self.resident.index(request)
            else:
                free = [s for s in range(len(self.resident)) if s not in taken]
                if not free:
                    raise RuntimeError(f"a step holds more than {len(self.resident)} adapters")
                slot = min(free, key=lambda s: (self.resident[s] is not None, self._slot_use[s]))
                taken.add(slot)
            self._slot_use[slot] = self._steps
            out.append((slot, request))
        slot_of = {r.lora_int_id: slot for slot, r in out}
        per_seq = [slot_of.get(s.lora_id, NO_ADAPTER) for s in seqs]
        return out, np.repeat(np.asarray(per_seq, dtype=np.int64), num_new_tokens)

    @contextmanager
    def running(self, step: StepLoRA) -> Iterator[None]:
        """While a step's eager forward runs: its slots filled, the model's hooks on its tokens."""
        self.slots.context.step = LoRAStep(self.step_mask(step))
        try:
            yield
        finally:
            self.slots.context.step = None

    def step_mask(self, step: StepLoRA, rows: int | None = None) -> torch.Tensor:
        """Fill the slots `step` needs; its tokens' one-hot slot mask `[rows, slots]` on the
        device in the model dtype, padded past the tokens with zero (base) rows to `rows`."""
        assigned, token_slots = step
        for slot, request in assigned:
            if self.resident[slot] != request:
                self.slots.fill(slot, self.adapter(request))
                self.resident[slot] = request
        rows = len(token_slots) if rows is None else rows
        mask = np.zeros((rows, self.slots.num_slots), dtype=np.float32)
        tokens = np.flatnonzero(token_slots != NO_ADAPTER)
        mask[tokens, token_slots[tokens]] = 1.0
        return self._to_device(mask).to(self.slots.dtype)

    @property
    def held(self) -> list[LoRARequest]:
        """The adapters in a device slot or the host cache, by name."""
        found = {r.lora_int_id: r for r in self.resident if r is not None}
        found.update((i, a.request) for i, a in self.host.items())
        return sorted(found.values(), key=lambda r: (r.lora_name, r.lora_int_id))


def request_adapter(manager: LoRAManager | None, lora: LoRARequest | None) -> LoRARequest | None:
    """A request's adapter, loaded into the host cache now so that a bad one fails the request
    (LoRAAdapterError) rather than a step."""
    if lora is None:
        return None
    if manager is None:
        raise LoRAAdapterError("LoRA adapters need an engine with enable_lora")
    manager.adapter(lora)
    return lora


def lora_stats(manager: LoRAManager | None) -> dict[str, list]:
    """`EngineStats`' adapters held (names, ids): what routing prefers and an unload frees."""
    held = [] if manager is None else manager.held
    return {"lora_resident": [r.lora_name for r in held],
            "lora_resident_ids": [r.lora_int_id for r in held]}  # fmt: skip


def build_lora(
    cfg: EngineConfig, model: LlamaForCausalLM, model_config: ModelConfig,
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> LoRAManager | None:  # fmt: skip
    """A rank's LoRA manager where `cfg.enable_lora`."""
    return LoRAManager(cfg, model, model_config, to_device) if cfg.enable_lora else None


def lora_step(manager: LoRAManager | None, step: StepLoRA | None) -> AbstractContextManager[None]:
    """The context a step's forward runs in: its adapters' hooks on, where it has any."""
    if manager is None or step is None:
        return nullcontext()
    return manager.running(step)


def lora_graph_mask(
    manager: LoRAManager | None, step: StepLoRA | None, rows: int
) -> torch.Tensor | None:
    """The slot mask a step's CUDA graph replays with (`rows`: the graph's size), its slots
    filled; None for a step without adapters."""
    return None if manager is None or step is None else manager.step_mask(step, rows)
