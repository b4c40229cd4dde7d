"""The KV hand-off between two processes on one GPU: a device copy through CUDA IPC.

A PrefillEngine runs in a child process (spawned, as a Serve replica at half a GPU would be) and
answers commands over a pipe, polling its NIXL agent in between; a DecodeEngine in this process
loads its record, finds its pool on the same GPU and copies the prompt's pages from it. The pages
must arrive bit for bit, the lease end by the notification, and a read whose pages were reused
meanwhile (their generation numbers bumped, as a free does) must fail the generation check and
be recomputed, exactly as a stale NIXL read is.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.test_handoff_vram import ENGINE, PROMPTS, greedy
from workers.config import EngineConfig, KVTransferConfig
from workers.disagg.decode import DecodeEngine
from workers.protocol import GenerateRequest

pytestmark = pytest.mark.gpu

DEADLINE_S = 60.0


def _serve_prefill(model: str, conn: Connection) -> None:
    """The child: a PrefillEngine on the same GPU, driven by (command, argument) messages."""
    from workers.disagg.prefill import PrefillEngine

    prefill = PrefillEngine(EngineConfig(model=model, **ENGINE), KVTransferConfig(lease_s=60.0))
    conn.send(prefill.agent.metadata())
    while True:
        prefill.poll()  # NIXL progresses only inside the agent's calls
        if not conn.poll(0.001):
            continue
        cmd, arg = conn.recv()
        if cmd == "stop":
            return
        if cmd == "prefill":
            prefill.add_request(arg)
            outs: list[Any] = []
            while not outs:
                outs = prefill.step()
            conn.send(outs[0])
        elif cmd == "pages":  # the bytes of these pages, as this process holds them
            conn.send(prefill.runner.pool.pages[arg].cpu())
        elif cmd == "reuse":  # what a free and a reallocation do to the pages' generations
            prefill.allocator.generation[arg] += 1
            conn.send(None)
        elif cmd == "pinned":
            conn.send(prefill.stats().kv_pages_pinned)


class Prefill:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def ask(self, cmd: str, arg: object = None) -> Any:
        self.conn.send((cmd, arg))
        assert self.conn.poll(DEADLINE_S), f"the prefill process did not answer {cmd}"
        return self.conn.recv()


@pytest.fixture(scope="module")
def engines(smollm2_random: Path) -> Iterator[tuple[Prefill, DecodeEngine]]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_serve_prefill, args=(str(smollm2_random), theirs), daemon=True)
    child.start()
    try:
        assert ours.poll(120), "the prefill process did not start"
        metadata = ours.recv()
        cfg = EngineConfig(model=str(smollm2_random), **ENGINE)
        decode = DecodeEngine(cfg, KVTransferConfig(lease_s=60.0), "d")
        decode.agent.add_peer(metadata)
        yield Prefill(ours), decode
        decode.agent.close()
        ours.send(("stop", None))
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


def drive(decode: DecodeEngine, done: Any, what: str) -> None:
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < DEADLINE_S, f"timed out waiting for {what}"
        decode.poll()
        decode.step()


def test_pages_are_copied_through_cuda_ipc(engines: tuple[Prefill, DecodeEngine]) -> None:
    prefill, decode = engines
    for i, prompt in enumerate(PROMPTS):
        req = GenerateRequest(request_id=f"s{i}", prompt_token_ids=prompt, params=greedy())
        first = prefill.ask("prefill", req)
        assert first.kv is not None
        copies = decode.agent.stats().device_copies
        decode.add_remote(req, first)
        seq = decode.seqs[req.request_id]
        drive(decode, lambda: not decode.pending, "the KV read")
        assert decode.agent.stats().device_copies == copies + 1  # not over NIXL
        src = prefill.ask("pages", first.kv.page_ids)
        ps, n = first.kv.layout[0].page_size, first.kv.num_tokens
        for j, mine in enumerate(seq.pages[: len(first.kv.page_ids)]):
            count = min(ps, n - j * ps)  # [layers, 2, page_size, heads, dim]: filled slots
            got = decode.runner.pool.pages[mine][:, :, :count].cpu()
            assert torch.equal(got, src[j][:, :, :count]), (i, j)
        drive(decode, lambda s=seq: s.finished, "the decode")
        assert len(seq.output_token_ids) == greedy().max_tokens
    t0 = time.monotonic()
    while prefill.ask("pinned"):  # every lease ended by the reader's notification
        assert time.monotonic() - t0 < DEADLINE_S, "leases were not released"
    assert decode.stats().num_recomputed == 0


def test_a_copy_of_reused_pages_fails_the_generation_check(
    engines: tuple[Prefill, DecodeEngine],
) -> None:
    prefill, decode = engines
    prompt = [(13 * j) % 30000 + 200 for j in range(70)]
    req = GenerateRequest(request_id="stale", prompt_token_ids=prompt, params=greedy())
    first = prefill.ask("prefill", req)
    assert first.kv is not None
    prefill.ask("reuse", first.kv.page_ids)  # freed and taken again before the read
    copies, recomputed = decode.agent.stats().device_copies, decode.num_recomputed
    decode.add_remote(req, first)
    seq = decode.seqs[req.request_id]
    drive(decode, lambda: seq.finished, "the recomputed request")
    assert decode.agent.stats().device_copies == copies + 1  # the copy ran, the check refused it
    assert decode.num_recomputed == recomputed + 1
    assert len(seq.output_token_ids) == greedy().max_tokens
    assert decode.stats().kv_pages_pinned == 0
