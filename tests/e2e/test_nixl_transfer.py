"""Real NIXL (UCX over DRAM) between two Ray actors, each with a KV pool and a transfer agent.

Peers find each other only through the metadata published in Ray's internal KV store.
Every wait has a deadline, so a transport that hangs fails the test instead of stalling it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from tests.waiting import wait_until
from workers.kvcache.pool import KVPool
from workers.protocol import KVLayout
from workers.transfer import (
    KVLayoutMismatchError,
    KVTransferAgent,
    TransferError,
)

pytestmark = pytest.mark.e2e

LAYOUT = KVLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
NUM_PAGES = 64
DEADLINE_S = 10.0
REPO = str(Path(__file__).resolve().parents[2])


class KVWorker:
    """A stand-in for one worker rank: a KV pool and its transfer agent.

    A prefill worker runs `serve()`, the stand-in for its engine loop: from then on that loop is
    the only thread that calls the agent, and it calls `get_notifs()` every millisecond, which
    also progresses the reads peers make of its pages (no NIXL progress thread by default).
    """

    def __init__(self, role: str, tag: str, **agent_kw: Any) -> None:
        self.pool = KVPool(LAYOUT, NUM_PAGES, "cpu")
        self.agent = KVTransferAgent(self.pool, role, tag, rank=0, **agent_kw)
        self.generation = torch.arange(NUM_PAGES, dtype=torch.int64) * 10
        self.agent.track_generations(self.generation)
        self.notifs: list[tuple[str, bytes]] = []

    def name(self) -> str:
        return self.agent.name

    def pid(self) -> int:
        return os.getpid()

    def serve(self) -> None:
        while True:
            for name, msgs in self.agent.get_notifs().items():
                self.notifs.extend((name, m) for m in msgs)
            time.sleep(0.001)

    def fill(self, offset: float) -> None:
        pages = self.pool.pages
        pages.copy_(offset + torch.arange(pages.numel()).view_as(pages))

    def page_bytes(self, pages: list[int]) -> list[bytes]:
        return [self.pool.pages[p].numpy().tobytes() for p in pages]

    def read(
        self, remote: str, remote_pages: list[int], local_pages: list[int], msg: bytes
    ) -> dict[str, Any]:
        """Post a READ and poll it to the end or the deadline; report what happened."""
        t0 = time.monotonic()
        try:
            handle = self.agent.read_pages(remote, remote_pages, local_pages, msg)
        except TransferError as e:  # includes PeerUnavailableError
            return {"state": "raised", "error": str(e), "seconds": time.monotonic() - t0}
        while self.agent.poll(handle) == "PROC" and time.monotonic() - t0 < DEADLINE_S:
            time.sleep(0.001)
        self.agent.release(handle)
        return {
            "state": handle.state,
            "num_descriptors": handle.num_descriptors,
            "num_bytes": handle.num_bytes,
            "seconds": time.monotonic() - t0,
        }

    def free_page(self, page: int) -> None:
        self.generation[page] += 1  # what PageAllocator.free does

    def read_generations(self, remote: str, page_lists: list[list[int]]) -> dict[str, Any]:
        """Post one generation READ per list, all in flight at once, then poll each to the end."""
        handles = [self.agent.read_generations(remote, pages) for pages in page_lists]
        t0 = time.monotonic()
        for h in handles:
            while self.agent.poll(h) == "PROC" and time.monotonic() - t0 < DEADLINE_S:
                time.sleep(0.001)
            self.agent.release(h)
        return {"states": [h.state for h in handles], "values": [h.generations for h in handles]}

    def send_notif(self, remote: str, msg: bytes) -> None:
        self.agent.send_notif(remote, msg)

    def wait_notifs(self, count: int) -> dict[str, list[bytes]]:
        """The notifications `serve()` collected, once `count` are there or at the deadline."""
        t0 = time.monotonic()
        while len(self.notifs) < count and time.monotonic() - t0 < DEADLINE_S:
            time.sleep(0.001)
        got: dict[str, list[bytes]] = {}
        for name, msg in self.notifs:
            got.setdefault(name, []).append(msg)
        self.notifs.clear()
        return got

    def forget(self, remote: str) -> None:
        self.agent.forget_peer(remote)

    def stats(self) -> dict[str, Any]:
        return vars(self.agent.stats())


def start(role: str, tag: str, **agent_kw: Any) -> Any:
    return ray.remote(num_cpus=0, max_concurrency=2)(KVWorker).remote(role, tag, **agent_kw)


@dataclass
class Workers:
    prefill: Any
    decode: dict[str, Any]  # by xfer mode
    doomed: Any  # a prefill worker that one test kills
    prefill_name: str
    decode_name: dict[str, str]
    doomed_name: str


@pytest.fixture(scope="module")
def workers(ray_cluster: None) -> Iterator[Workers]:
    modes = ["prepped", "merged"]
    decode = {m: start("decode", f"r{i}", xfer_mode=m) for i, m in enumerate(modes)}
    prefill = start("prefill", "r0")
    doomed = start("prefill", "doomed", progress_thread=True)  # needs no serving loop
    actors = [prefill, doomed, *decode.values()]
    names = ray.get([a.name.remote() for a in actors])  # they all start in parallel
    prefill.serve.remote()  # runs until the actor dies
    decode_names = dict(zip(modes, names[2:], strict=True))
    yield Workers(prefill, decode, doomed, names[0], decode_names, names[1])
    for actor in actors:
        ray.kill(actor)


@pytest.mark.parametrize("mode", ["prepped", "merged"])
def test_decode_reads_prefill_pages_and_prefill_is_notified(workers: Workers, mode: str) -> None:
    w, decode = workers, workers.decode[mode]
    ray.get([w.prefill.fill.remote(1.0), decode.fill.remote(-1e6)])

    out = ray.get(decode.read.remote(w.prefill_name, [5, 6, 7, 20], [10, 11, 12, 3], b"lease-42"))

    assert out["state"] == "DONE", out
    assert out["num_descriptors"] == 2  # runs 5-7 -> 10-12 and 20 -> 3
    assert out["num_bytes"] == 4 * LAYOUT.page_bytes
    want = ray.get(w.prefill.page_bytes.remote([5, 6, 7, 20]))
    assert ray.get(decode.page_bytes.remote([10, 11, 12, 3])) == want
    assert ray.get(decode.page_bytes.remote([4]))[0] != want[0]  # other pages are untouched
    assert ray.get(w.prefill.wait_notifs.remote(1)) == {w.decode_name[mode]: [b"lease-42"]}
    stats = ray.get(decode.stats.remote())
    assert stats["bytes_transferred"] == 4 * LAYOUT.page_bytes and stats["num_descriptors"] == 2


def test_generation_reads_see_pages_freed_after_the_handle(workers: Workers) -> None:
    w, decode = workers, workers.decode["prepped"]
    before = ray.get(decode.read_generations.remote(w.prefill_name, [[5, 6, 7, 20], [1, 3]]))
    assert before["states"] == ["DONE", "DONE"]
    assert before["values"] == [[50, 60, 70, 200], [10, 30]]  # each READ has its own slot

    ray.get(w.prefill.free_page.remote(6))
    after = ray.get(decode.read_generations.remote(w.prefill_name, [[5, 6, 7, 20]]))
    assert after["values"] == [[50, 61, 70, 200]]


def test_standalone_notification_reaches_prefill(workers: Workers) -> None:
    w = workers
    ray.get(w.decode["prepped"].send_notif.remote(w.prefill_name, b"abort:lease-7"))
    got = ray.get(w.prefill.wait_notifs.remote(1))
    assert got == {w.decode_name["prepped"]: [b"abort:lease-7"]}


def test_read_is_refused_when_layouts_differ(workers: Workers) -> None:
    other = LAYOUT.model_copy(update={"page_size": 8})
    local = KVTransferAgent(KVPool(other, 8, "cpu"), "decode", "driver", rank=0)
    try:
        with pytest.raises(KVLayoutMismatchError, match="page_size"):
            local.read_pages(workers.prefill_name, [1], [1])
    finally:
        local.close()


def exited(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie has: its parent has yet to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # the state field follows "(comm)"


def test_reading_from_a_dead_prefill_fails_within_a_deadline(workers: Workers) -> None:
    w, decode = workers, workers.decode["prepped"]
    assert ray.get(decode.read.remote(w.doomed_name, [1, 2], [30, 31], b""))["state"] == "DONE"

    pid = ray.get(w.doomed.pid.remote())
    ray.kill(w.doomed, no_restart=True)
    wait_until(lambda: exited(pid), 30, what=f"the killed worker (pid {pid}) to exit")
    cached = ray.get(decode.read.remote(w.doomed_name, [1, 2], [30, 31], b""))
    ray.get(decode.forget.remote(w.doomed_name))  # a reader that meets the dead agent afresh
    fresh = ray.get(decode.read.remote(w.doomed_name, [1, 2], [30, 31], b""))

    for out in (cached, fresh):
        assert out["state"] in ("ERR", "raised"), out
        assert out["seconds"] < DEADLINE_S
    assert ray.get(decode.stats.remote())["num_failed_transfers"] >= 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_staged_read_puts_a_decode_rank_heads_in_place(device: str) -> None:
    """Heterogeneous TP between two agents of this process (no Ray): the reader holds KV heads
    [2, 4) of 4, the owner all of them (DRAM, or VRAM of one GPU)."""
    from workers.transfer.head_slices import staging_pages
    from workers.transfer.kv_read import KVRead, ReadSpec

    full = KVLayout(num_layers=3, page_size=4, num_kv_heads=4, head_dim=64, dtype="bfloat16")
    half = full.model_copy(update={"num_kv_heads": 2, "kv_head_offset": 2})
    src, dst = KVPool(full, 16, device), KVPool(half, 64, device)
    src.pages.normal_()
    owner = KVTransferAgent(src, "prefill", "staged", rank=0, publish=False)
    reader = KVTransferAgent(dst, "decode", "staged", rank=0, publish=False)
    try:
        reader.add_peer(owner.metadata())
        remote, local = [3, 4, 5, 9], [1, 2, 7, 8]
        spare = list(range(20, 20 + staging_pages(len(remote), full, half)))
        read = KVRead(reader, dst.pages, ReadSpec([owner.name], [full], remote, local, spare))
        t0 = time.monotonic()
        while (state := read.poll()) == "PROC" and time.monotonic() - t0 < DEADLINE_S:
            owner.get_notifs()  # the owner's side of the UCX wire-up (no progress thread)
        read.release()
        assert state == "DONE"
        assert torch.equal(dst.pages[local], src.pages[remote][..., 2:4, :])
        assert not dst.pages[[p for p in range(64) if p not in local + spare]].any()
    finally:
        reader.close()
        owner.close()
