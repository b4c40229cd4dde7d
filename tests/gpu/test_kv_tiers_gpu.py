"""KV tiers on a GPU: pages forced out of a small device pool go down to pinned host memory (and
files) on the copy stream and come back on the load stream, overlapped with other steps; the
greedy tokens are those of an engine without tiers, and no device page or host row leaks.

float32 with the torch backend on SmolLM2's shape (random weights), as test_engine_gpu.py: a
different batch composition cannot flip a greedy token there, so tokens must match exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_checks import drain_and_check_released
from tests.unit.test_kv_tiers import GREEDY, POOL, TURN1, TURN2, pages_gb, two_turns
from workers import LLM
from workers.config import KVOffloadConfig

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
