"""Tensor parallelism over N processes: rank 0 drives, ranks 1..N-1 follow its plans.

Rank 0 is the engine's own runner (`TPDriverRunner`): the scheduler, the KV manager and sampling
stay in the engine's process. Each step, rank 0 makes the `StepPlan` as a single rank would,
broadcasts it over the control (gloo) group, and every rank runs `run_plan`; the model's
row-parallel all-reduces and the LM head's all-gather keep the ranks in lockstep. Rank 0 alone
samples.

Unseen tokens (overlap scheduling): a plan may take tokens from the last launch's sampled ids,
which only rank 0 has, on the device. Rank 0 then broadcasts those ids on the device right after
the plan (queued like any collective: no host sync), and the other ranks use them as their
`_prev`. A plan without unseen tokens sends nothing more.

Between steps rank 0 may also send a `RankCommand` (e.g. the KV hand-off's transfer ops, see
`workers/disagg/group_transfer.py`): every rank 1..N-1 runs it and the answers are gathered back to
rank 0 over the control group. Nothing is sent unless an engine asks (never at TP=1).

Invariant: every rank's KV pool has the same number of pages (the fewest any rank can hold), so
rank 0's page ids are valid on every rank.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from workers.config import EngineConfig
from workers.engine.model_runner import ModelRunner
from workers.model.files import load_model_config, resolve_model
from workers.model.llama import LlamaForCausalLM
from workers.parallel.group import SINGLE, TPGroup
from workers.parallel.rendezvous import destroy_group, free_port, init_group
from workers.scheduler.step import StepOutputs, StepPlan

if TYPE_CHECKING:
    from workers.engine.cuda_graph import DecodeCudaGraphs
    from workers.parallel.ranks import RankActors, TPRankError

logger = logging.getLogger(__name__)


def create_runner(cfg: EngineConfig, tp: TPGroup = SINGLE) -> ModelRunner:
    """The engine's runner: a plain `ModelRunner`, or rank 0 of a group of
    `cfg.tensor_parallel_size` ranks."""
    if cfg.tensor_parallel_size == 1 or tp.size > 1:
        return ModelRunner(cfg, tp)
    return TPDriverRunner(cfg)


@dataclass
class RankStep:
    """What rank 0 sends before each step: the plan, and how many sampled ids follow it on the
    device (0: the plan has no unseen tokens)."""

    plan: StepPlan
    num_prev: int


class RankCommand:
    """Work for ranks 1..N-1 between steps. `run` must not raise (an exception ends the rank):
    it returns its answer, errors included, which rank 0 gets from `TPDriverRunner.command`."""

    def run(self, runner: RankRunner) -> Any:
        raise NotImplementedError


class RemoveLoRA(RankCommand):
    """Forget an unloaded LoRA adapter (host copy, slot); answers whether this rank held it."""

    def __init__(self, lora_int_id: int) -> None:
        self.lora_int_id = lora_int_id

    def run(self, runner: RankRunner) -> bool:
        return runner.lora is not None and runner.lora.remove(self.lora_int_id)


def remove_lora(runner: ModelRunner, lora_int_id: int) -> bool:
    """Forget an unloaded adapter on every rank of `runner`'s group; whether rank 0 held it."""
    if runner.lora is None:
        return False
    if isinstance(runner, TPDriverRunner):
        runner.command(RemoveLoRA(lora_int_id))
    return runner.lora.remove(lora_int_id)


class RankRunner(ModelRunner):
    """A runner inside a TP group (any rank)."""

    transfer: Any = None  # ranks 1..N-1: state their commands keep (the rank's KV transfers)

    def _num_pages(self) -> int:
        return self.tp.min_int(super()._num_pages())  # same page ids on every rank

    @torch.inference_mode()
    def follow(self, step: RankStep) -> None:
        """Run rank 0's step here (ranks 1..N-1); the logits are rank 0's business."""
        if step.num_prev:
            ids = torch.empty(step.num_prev, dtype=torch.int64, device=self.device)
            self._prev = (self.tp.broadcast(ids), {})
        self.run_plan(step.plan)


def _device(cfg: EngineConfig) -> torch.device:
    """This rank's device with its index (NCCL needs one): each rank sees its own GPU as 0."""
    device = cfg.resolved_device()
    return torch.device("cuda", 0) if device.type == "cuda" else device


def _check_shardable(cfg: EngineConfig) -> None:
    """Raise the layers' own error (heads, features not divisible) before any rank starts."""
    model_config = load_model_config(resolve_model(cfg.model, cfg.load_format))
    model_config = model_config.model_copy(update={"expert_parallel": cfg.expert_parallel})
    with torch.device("meta"):
        LlamaForCausalLM(model_config, TPGroup(0, cfg.tensor_parallel_size))


class TPDriverRunner(RankRunner):
    """Rank 0: starts ranks 1..N-1 and sends them every plan it runs."""

    def __init__(self, cfg: EngineConfig) -> None:
        import ray

        from workers.parallel.ranks import RankActors

        _check_shardable(cfg)
        size, device = cfg.tensor_parallel_size, _device(cfg)
        ranks = RankActors(RankWorker, cfg, size, device)
        try:
            host = ray.util.get_node_ip_address()
            address = f"{host}:{free_port(host)}"
            started = ranks.start(address)
            tp = init_group(0, size, address, device, ipc_all_reduce=cfg.kernels.ipc_all_reduce)
            super().__init__(cfg, tp)
            ranks.wait_started(started)
            ranks.serve()
        except BaseException:
            ranks.stop()
            _leave_group(getattr(self, "graphs", None))
            raise
        self._ranks: RankActors = ranks
        self._error: TPRankError | None = None
        self._finalizer = weakref.finalize(self, _shutdown, self.tp, ranks, self.graphs)
        logger.info("tensor parallel engine: %d ranks on %s", size, address)

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> StepOutputs:
        if self._error is not None:
            raise self._error
        try:
            prev = self._prev[0] if plan.unseen.shape[1] and self._prev is not None else None
            self.tp.broadcast_object(RankStep(plan, 0 if prev is None else len(prev)))
            if prev is not None:
                self.tp.broadcast(prev.to(torch.int64))
            return super().run_plan(plan)
        except Exception as e:
            # Any failure here leaves the ranks' collectives out of step: no step can follow.
            self._error = self._ranks.failure(e)
            raise self._error from e

    def command(self, cmd: RankCommand) -> list[Any]:
        """Run `cmd` on ranks 1..N-1; their answers in rank order (rank 1 first)."""
        if self._error is not None:
            raise self._error
        try:
            self.tp.broadcast_object(cmd)
            answers = self.tp.gather_object(None)
        except Exception as e:
            self._error = self._ranks.failure(e)
            raise self._error from e
        assert answers is not None
        return answers[1:]

    def check_alive(self) -> None:
        """Raise if a rank died or a step broke the group (Serve's health check)."""
        if self._error is None:
            self._error = self._ranks.dead_rank()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop ranks 1..N-1 and leave the group (also on garbage collection and at exit)."""
        self._finalizer()


def _leave_group(graphs: DecodeCudaGraphs | None) -> None:
    """Destroy this process's TP communicator, once no CUDA graph holds its collectives (see
    `DecodeCudaGraphs.release`)."""
    if graphs is not None:
        graphs.release()
    destroy_group()


def _shutdown(tp: TPGroup, ranks: RankActors, graphs: DecodeCudaGraphs | None) -> None:
    left = False
    try:
        if not ranks.broken and ranks.actors:
            tp.broadcast_object(None)  # ranks leave their loops, then the group
            # NCCL's destroy waits for every rank's (two H200s: rank 0's took 5 s behind a rank
            # 5 s late), so rank 0 leaves with them, before it waits for them.
            _leave_group(graphs)
            left = True
            ranks.join()
    except Exception as e:  # noqa: BLE001 - the ranks are killed below either way
        logger.warning("TP stop broadcast failed: %s", e)
    try:
        ranks.stop()
    except Exception as e:  # noqa: BLE001 - Ray may already be down at interpreter exit
        logger.warning("stopping TP ranks failed: %s", e)
    if not left:
        _leave_group(graphs)


def _die(what: str) -> None:
    """Log and end this rank's process: its sockets close, so rank 0's pending collective fails
    at once instead of waiting for the timeout."""
    logger.exception("%s; exiting", what)
    logging.shutdown()
    os._exit(1)


class RankWorker:
    """Ranks 1..N-1, each a Ray actor: build the shard, then run rank 0's plans until stopped."""

    def __init__(self, cfg: EngineConfig, rank: int, size: int) -> None:
        logging.basicConfig(level=logging.INFO)
        self.cfg, self.rank, self.size = cfg, rank, size
        self.device = _device(cfg)
        self.runner: RankRunner | None = None

    def device_uuid(self) -> str | None:
        if self.device.type != "cuda":
            return None
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def start(self, address: str) -> None:
        try:
            tp = init_group(
                self.rank, self.size, address, self.device,
                ipc_all_reduce=self.cfg.kernels.ipc_all_reduce,
            )  # fmt: skip
            self.runner = RankRunner(self.cfg, tp)
        except BaseException:  # noqa: BLE001 - see _die
            _die(f"TP rank {self.rank} could not start")

    def serve(self) -> Any:
        assert self.runner is not None
        tp = self.runner.tp
        try:
            while (step := tp.broadcast_object(None)) is not None:
                if isinstance(step, RankCommand):
                    tp.gather_object(step.run(self.runner))
                else:
                    self.runner.follow(step)  # type: ignore[arg-type]
        except BaseException:  # noqa: BLE001 - see _die
            _die(f"TP rank {self.rank} failed a step")
        _leave_group(self.runner.graphs)
        logger.info("TP rank %d stopped", self.rank)
