"""KV tiers on a GPU: pages forced out of a small device pool go down to pinned host memory (and
files) on the copy stream and come back on the load stream, overlapped with other steps; the
greedy tokens are those of an engine without tiers, and no device page or host row leaks.

float32 with the torch backend on SmolLM2's shape (random weights), as test_engine_gpu.py: a
different batch composition cannot flip a greedy token there, so tokens must match exactly. The
stress tests delay every copy down and every load on its own stream, so a missing wait shows;
the last one runs the served configuration (bfloat16, FlashInfer, CUDA graphs), judged against
HF float32 as test_engine_gpu.py does.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tests.engine_checks import drain_and_check_released
from tests.gpu.conftest import hf_judge
from tests.gpu.test_engine_gpu import LOGIT_SLACK
from tests.unit.test_kv_tiers import GREEDY, POOL, TURN1, TURN2, pages_gb, two_turns
from workers import LLM, SamplingParams
from workers.config import KVOffloadConfig
from workers.protocol import GenerateRequest

pytestmark = pytest.mark.gpu

GPU = dict(device="cuda", dtype="float32", attention_backend="torch")


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_tiers_on_gpu_give_the_tokens_of_no_tiers(
    smollm2_random: Path, tmp_path: Path, tier: str
) -> None:
    model = str(smollm2_random)
    ref = LLM(model, **GPU, **POOL)  # the same small pool, evicting to nothing
    expected = ([o.token_ids for o in ref.generate(TURN1, GREEDY)],
                [o.token_ids for o in ref.generate(TURN2, GREEDY)])  # fmt: skip
    if tier == "host":
        tiers = KVOffloadConfig(cpu_gb=pages_gb(model, 100, **GPU))
    else:  # 6 host rows: most pages go on to files and come back through the pinned staging
        tiers = KVOffloadConfig(cpu_gb=pages_gb(model, 6, **GPU), disk_dir=str(tmp_path),
                                disk_gb=pages_gb(model, 200, **GPU))  # fmt: skip
    llm = LLM(model, **GPU, **POOL, kv_offload=tiers)
    assert llm.engine.runner.pool.pages.is_cuda
    cached = two_turns(llm, expected)
    assert all(c == 40 for c in cached), cached  # every document, loaded back
    stats = llm.engine.stats()
    hits = stats.kv_host_hit_tokens if tier == "host" else stats.kv_disk_hit_tokens
    assert hits >= 40 * 3 and stats.kv_onloads >= 3 and stats.kv_onload_time_s > 0
    drain_and_check_released(llm.engine)
    store = llm.engine.kv.tiers
    assert store is not None and store.num_loading == 0
    assert all(e.pins == 0 for e in store.host.entries.values())
    assert store.host.num_free + len(store.host) == store.host.capacity  # no host row leaked


SLEEP_CYCLES = 1_000_000  # ~0.5 ms of GPU time
DOCS = [[100 + 37 * d + i for i in range(40)] for d in range(8)]  # 10 pages each; the pool: 29
LONG = [[500 + 31 * i + j for j in range(20)] for i in range(4)]  # 15 pages each by their end
LONG_PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def rounds() -> list[dict[str, tuple[list[int], SamplingParams]]]:
    """Three rounds, each started at once: the documents' first turns; their second turns with
    sequences that outgrow the pool; their third turns."""

    def turn(t: int) -> dict[str, tuple[list[int], SamplingParams]]:
        return {f"d{d}t{t}": (doc + [7, 8, 9 + t], GREEDY) for d, doc in enumerate(DOCS)}

    second = turn(1) | {f"long{i}": (p, LONG_PARAMS) for i, p in enumerate(LONG)}
    return [turn(0), second, turn(2)]


@pytest.fixture
def late_side_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy down and every load lands late (a kernel ahead of it on its own stream), so a
    step that did not wait for a copy, or a load that did not wait for a step, shows in the
    tokens."""
    from workers.kvcache.tiers import data

    down, runs = data.TierData._down, data._runs

    def late_down(self: data.TierData, slot: int, page: int) -> None:
        with torch.cuda.stream(self._copy):
            torch.cuda._sleep(SLEEP_CYCLES)
        down(self, slot, page)

    def late_runs(sources: list) -> list:
        torch.cuda._sleep(SLEEP_CYCLES)  # on the load stream: `_run` calls it there
        return runs(sources)

    monkeypatch.setattr(data.TierData, "_down", late_down)
    monkeypatch.setattr(data, "_runs", late_runs)


@pytest.mark.usefixtures("late_side_streams")
@pytest.mark.parametrize(("tier", "overlap"), [("host", True), ("disk", True), ("host", False)])
def test_loads_spills_and_preemptions_at_once_give_the_tokens_of_no_tiers(
    smollm2_random: Path, tmp_path: Path, tier: str, overlap: bool
) -> None:
    """Each round starts all its requests at once on a 29-page pool: loads run beside spills,
    decodes and preemptions (swaps), and two requests are aborted while they load. Every other
    request's greedy tokens are those of an engine without tiers; nothing leaks."""
    model = str(smollm2_random)
    ref = LLM(model, **GPU, page_size=4, num_kv_pages=600, enable_prefix_caching=False)
    if tier == "host":
        tiers = KVOffloadConfig(cpu_gb=pages_gb(model, 100, **GPU))
    else:  # 6 host rows, reused all the time: most pages go on to files and come back
        tiers = KVOffloadConfig(cpu_gb=pages_gb(model, 6, **GPU), disk_dir=str(tmp_path),
                                disk_gb=pages_gb(model, 300, **GPU))  # fmt: skip
    llm = LLM(model, **GPU, **POOL, kv_offload=tiers, overlap_scheduling=overlap)
    engine, aborted = llm.engine, set[str]()
    for requests in rounds():
        expected = ref.generate([p for p, _ in requests.values()],
                                [s for _, s in requests.values()])  # fmt: skip
        got: dict[str, list[int]] = {rid: [] for rid in requests}
        for rid, (prompt, params) in requests.items():
            engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                               params=params))  # fmt: skip
        for step in itertools.count():
            if step == 1:  # the first step started the loads it could
                for seq in list(engine.scheduler.loading)[:2]:
                    engine.abort(seq.request_id)
                    aborted.add(seq.request_id)
            if not engine.has_work():
                break
            for chunk in engine.step():
                got[chunk.request_id] += chunk.token_ids
        for rid, out in zip(requests, expected, strict=True):
            assert rid in aborted or got[rid] == out.token_ids, rid
    stats = engine.stats()
    assert stats.kv_onloads >= 4 and aborted
    if not overlap:  # with overlap a sequence short of a page may wait a step instead
        assert stats.num_swap_preemptions > 0
    drain_and_check_released(engine)
    store = engine.kv.tiers
    assert store is not None and store.num_loading == 0
    assert all(e.pins == 0 for e in store.host.entries.values())
    assert store.host.num_free + len(store.host) == store.host.capacity


@pytest.mark.usefixtures("late_side_streams")
def test_flashinfer_steps_behind_late_copies_down_keep_their_schedules(
    smollm2_random: Path, hf_fp32_gpu: object
) -> None:
    """bfloat16, FlashInfer, CUDA graphs and overlap, as served: a step queued behind copies
    down (the pool evicting) starts late, so the host plans the next step first; each plan's
    schedule must still reach its own step (`workers/attention/replan_gate.py`). Tokens are
    judged against HF float32 (bf16 flips near-ties with the batch: `test_engine_gpu.py`)."""
    model = str(smollm2_random)
    host_gb = pages_gb(model, 50, **GPU)  # 50 float32 pages: 100 of bfloat16
    llm = LLM(model, device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              cuda_graph_batch_sizes=(1, 2, 4, 8, 16), overlap_scheduling=True, **POOL,
              kv_offload=KVOffloadConfig(cpu_gb=host_gb))  # fmt: skip
    for requests in rounds():
        outs = llm.generate([p for p, _ in requests.values()], [s for _, s in requests.values()])
        for (prompt, params), out in zip(requests.values(), outs, strict=True):
            assert len(out.token_ids) == params.max_tokens
            _, shortfall = hf_judge(hf_fp32_gpu, prompt, out.token_ids)
            assert float(shortfall.max()) < LOGIT_SLACK, f"token far from HF's best: {shortfall}"
    stats = llm.engine.stats()
    assert stats.kv_onloads >= 4 and stats.kv_offload_bytes > 0
    drain_and_check_released(llm.engine)
