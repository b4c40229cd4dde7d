"""KV tiers below the device pool (host memory, disk) on the CPU: greedy tokens identical with
and without them, pages really evicted and loaded back (the hit counters), FP8 pages, disk files
reused by a restarted engine and ignored by another model's, and no leak after aborts."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.engine_checks import drain_and_check_released, engine_pair, prefill_then_decode
from workers import LLM, SamplingParams
from workers.config import EngineConfig, KVOffloadConfig
from workers.engine_stats import EngineStats
from workers.protocol import GenerateRequest

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DOCS = [[100 + 37 * d + i for i in range(40)] for d in range(6)]  # 10 pages of 4 tokens each
TURN1 = [doc + [7, 8, 9] for doc in DOCS]
TURN2 = [doc + [11, 12, 13, 14] for doc in DOCS]
POOL = dict(page_size=4, num_kv_pages=30, max_num_batched_tokens=64)  # 29 pages < 6 documents
Expected = tuple[list[list[int]], list[list[int]]]  # the two turns' greedy tokens


@pytest.fixture(scope="module")
def expected(tiny_llama: str) -> Expected:
    ref = LLM(tiny_llama, enable_prefix_caching=False, max_num_batched_tokens=4096)
    return ([o.token_ids for o in ref.generate(TURN1, GREEDY)],
            [o.token_ids for o in ref.generate(TURN2, GREEDY)])  # fmt: skip


def pages_gb(llm_or_model: str, num_pages: int, **options: object) -> float:
    """`num_pages` pages of the model's pool, in GiB (a tier's size)."""
    layout = LLM(llm_or_model, num_kv_pages=2, page_size=4, **options).engine.runner.pool.layout
    return num_pages * layout.page_bytes / 2**30


def disk_tiers(model: str, host_pages: int, directory: Path) -> KVOffloadConfig:
    """A host tier of `host_pages` pages over a 200-page disk tier in `directory`."""
    return KVOffloadConfig(cpu_gb=pages_gb(model, host_pages), disk_dir=str(directory),
                           disk_gb=pages_gb(model, 200))  # fmt: skip


def two_turns(llm: LLM, expected: Expected) -> list[int]:
    """Run both turns, check the tokens, return the second turn's cached tokens."""
    assert [o.token_ids for o in llm.generate(TURN1, GREEDY)] == expected[0]
    second = llm.generate(TURN2, GREEDY)
    assert [o.token_ids for o in second] == expected[1]
    return [o.num_cached_tokens for o in second]


def test_without_tiers_second_turns_miss(tiny_llama: str, expected: Expected) -> None:
    cached = two_turns(LLM(tiny_llama, **POOL), expected)
    assert sum(cached) < 40  # the pool holds under three documents: most were evicted


def test_host_tier_serves_second_turns_token_identical(tiny_llama: str, expected: Expected) -> None:
    llm = LLM(tiny_llama, **POOL, kv_offload=KVOffloadConfig(cpu_gb=pages_gb(tiny_llama, 100)))
    cached = two_turns(llm, expected)
    stats = llm.engine.stats()
    assert all(c == 40 for c in cached), cached  # every document, from either tier
    assert stats.kv_host_hit_tokens >= 40 * 3 and stats.kv_onloads >= 3
    assert stats.kv_onload_bytes > 0 and stats.kv_offload_bytes > 0
    assert stats.kv_host_pages > 0 and stats.kv_disk_pages == 0
    drain_and_check_released(llm.engine)


def test_disk_tier_below_a_small_host_tier_token_identical(
    tiny_llama: str, expected: Expected, tmp_path: Path
) -> None:
    tiers = disk_tiers(tiny_llama, 6, tmp_path)
    llm = LLM(tiny_llama, **POOL, kv_offload=tiers)
    cached = two_turns(llm, expected)
    stats = llm.engine.stats()
    assert all(c == 40 for c in cached), cached
    assert stats.kv_disk_hit_tokens > 0 and stats.kv_disk_pages > 0
    assert stats.kv_host_pages <= 6
    drain_and_check_released(llm.engine)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])  # int8: scales inside the pages
def test_one_byte_pages_stay_as_they_are_through_the_host_tier(
    tiny_llama: str, kv_dtype: str
) -> None:
    fp8 = dict(kv_cache_dtype=kv_dtype)
    ref = LLM(tiny_llama, enable_prefix_caching=False, max_num_batched_tokens=4096, **fp8)
    expected = ([o.token_ids for o in ref.generate(TURN1, GREEDY)],
                [o.token_ids for o in ref.generate(TURN2, GREEDY)])  # fmt: skip
    gb = pages_gb(tiny_llama, 100, **fp8)
    llm = LLM(tiny_llama, **POOL, **fp8, kv_offload=KVOffloadConfig(cpu_gb=gb))
    assert all(c == 40 for c in two_turns(llm, expected))
    tiers = llm.engine.kv.tiers
    assert tiers is not None and tiers.page_bytes == llm.engine.runner.pool.layout.page_bytes
    assert llm.engine.stats().kv_host_hit_tokens > 0  # one byte an element: as it was


def test_a_restarted_engine_reuses_its_disk_files_and_others_ignore_them(
    tiny_llama: str, expected: Expected, tmp_path: Path
) -> None:
    tiers = disk_tiers(tiny_llama, 4, tmp_path)
    first = LLM(tiny_llama, **POOL, kv_offload=tiers)
    assert [o.token_ids for o in first.generate(TURN1, GREEDY)] == expected[0]
    assert first.engine.kv.tiers is not None
    first.engine.kv.tiers.flush()
    files = sorted(tmp_path.iterdir())
    assert len(files) >= 30
    # Another page size, another model dtype: the files are not theirs, left alone.
    for other in (dict(POOL, page_size=8), dict(POOL, kv_cache_dtype="fp8_e4m3")):
        llm = LLM(tiny_llama, **other, kv_offload=tiers)
        assert llm.engine.kv.tiers is not None and llm.engine.kv.tiers.disk is not None
        assert len(llm.engine.kv.tiers.disk) == 0
    assert sorted(tmp_path.iterdir()) == files
    # The same configuration restarted: the second turns find the documents on disk.
    again = LLM(tiny_llama, **POOL, kv_offload=tiers)
    assert again.engine.stats().kv_disk_pages == len(files)
    second = again.generate(TURN2, GREEDY)
    assert [o.token_ids for o in second] == expected[1]
    # Pages go down on eviction only: the documents the first pool still held are not on disk.
    assert [o.num_cached_tokens for o in second][:3] == [40] * 3
    assert again.engine.stats().kv_disk_hit_tokens >= 40 * 3


def test_aborts_mid_load_leak_no_page(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, **POOL, kv_offload=KVOffloadConfig(cpu_gb=pages_gb(tiny_llama, 100)))
    llm.generate(TURN1, GREEDY)  # the early documents go down to host memory
    engine, tiers = llm.engine, llm.engine.kv.tiers
    assert tiers is not None
    for i, prompt in enumerate(TURN2):
        engine.add_request(GenerateRequest(request_id=f"a{i}", prompt_token_ids=prompt,
                                           params=GREEDY))  # fmt: skip
    engine.step()  # admits what it can, starts the loads of the others
    assert engine.scheduler.loading and tiers.num_loading
    for i in range(len(TURN2)):
        engine.abort(f"a{i}")
    assert not engine.has_work() or not engine.scheduler.loading
    tiers.flush()
    engine.kv.finished_onloads()  # the loads end unwatched: their pages join the tree
    assert tiers.num_loading == 0
    assert all(e.pins == 0 for e in tiers.host.entries.values())
    assert tiers.host.num_free + len(tiers.host) == tiers.host.capacity  # no host row leaked
    drain_and_check_released(engine)
    assert engine.allocator.num_free + engine.kv.radix.num_cached_pages == 29  # type: ignore[union-attr]


def test_offload_config_is_checked() -> None:
    with pytest.raises(ValidationError, match="disk_dir and kv_offload.disk_gb go together"):
        KVOffloadConfig(cpu_gb=1, disk_dir="/tmp/x")
    with pytest.raises(ValidationError, match="greater than 0"):
        KVOffloadConfig(cpu_gb=0)
    with pytest.raises(ValidationError, match="needs enable_prefix_caching"):
        EngineConfig(enable_prefix_caching=False, kv_offload={"cpu_gb": 1})
    assert EngineConfig().kv_offload is None


def test_preempted_sequences_swap_to_host_memory_and_back(tiny_llama: str) -> None:
    """Four sequences outgrow the pool (4 x 15 pages > 29): the preempted ones' pages go down
    to host memory and are loaded back, not recomputed; the tokens are those of a large pool."""
    prompts = [[500 + 31 * i + j for j in range(20)] for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = LLM(tiny_llama, max_num_batched_tokens=4096)
    expected = [o.token_ids for o in ref.generate(prompts, params)]
    llm = LLM(tiny_llama, **POOL, kv_offload=KVOffloadConfig(cpu_gb=pages_gb(tiny_llama, 100)))
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.stats()
    assert stats.num_swap_preemptions == stats.num_preemptions > 0
    assert stats.kv_host_hit_tokens > 0
    assert stats.prompt_tokens_computed == sum(map(len, prompts))  # none recomputed
    drain_and_check_released(llm.engine)


def disaggregated_turns(
    prefill_cfg: EngineConfig, decode_cfg: EngineConfig, expected: Expected
) -> tuple[EngineStats, EngineStats]:
    """Both turns through prefill and decode engines in one process (NIXL over DRAM), each
    request's tokens checked against the colocated reference: the engines' stats."""
    with engine_pair(prefill_cfg, decode_cfg) as (prefill, decode):
        for turn, prompts in enumerate((TURN1, TURN2)):
            for i, prompt in enumerate(prompts):
                req = GenerateRequest(request_id=f"t{turn}-{i}", prompt_token_ids=prompt,
                                      params=GREEDY)  # fmt: skip
                assert prefill_then_decode(prefill, decode, req) == expected[turn][i]
        drain_and_check_released(decode)
        return prefill.stats(), decode.stats()


def test_pages_loaded_from_host_memory_cross_the_handoff(
    tiny_llama: str, expected: Expected
) -> None:
    """The prefill pool (29 pages) holds fewer than three documents: the second turns'
    documents come back from the prefill replica's host tier, and the decode replica's tokens
    are the colocated reference's."""
    tiers = KVOffloadConfig(cpu_gb=pages_gb(tiny_llama, 100))
    prefill, decode = disaggregated_turns(
        EngineConfig(model=tiny_llama, **POOL, kv_offload=tiers),
        EngineConfig(model=tiny_llama, page_size=4),
        expected,
    )
    assert prefill.kv_host_hit_tokens >= 40 * 3 and prefill.kv_onloads >= 3
    assert decode.num_recomputed == 0


def test_page_files_a_replica_cannot_trust_are_ignored(tmp_path: Path) -> None:
    """Under this replica's file name: a page written whole is taken back; a torn one, one whose
    header names another writer, and a file that is no page file are left alone."""
    import torch

    from workers.kvcache.tiers.disk import PageFiles
    from workers.kvcache.tiers.index import TierEntry

    meta = {"model": "m", "page_size": 4, "tp_rank": 0}
    files = PageFiles(str(tmp_path), 16, meta)
    for name in (1, 2, 3):
        files.write(TierEntry(name, 0, (name,) * 4), torch.full((16,), name, dtype=torch.uint8))
    torn = files.path(2)
    torn.write_bytes(torn.read_bytes()[:-1])
    other = PageFiles(str(tmp_path / "x"), 16, dict(meta, tp_rank=1))
    other.write(TierEntry(3, 0, (3,) * 4), torch.zeros(16, dtype=torch.uint8))
    files.path(3).write_bytes(other.path(3).read_bytes())  # our name, another rank's header
    (tmp_path / f"{files.prefix}-ffff.kv").write_bytes(b"not a page")
    [entry] = PageFiles(str(tmp_path), 16, meta).scan(capacity=10)
    assert (entry.name, entry.tokens) == (1, (1,) * 4)
    page = torch.zeros(16, dtype=torch.uint8)
    files.read_into(entry, page)
    assert page.tolist() == [1] * 16
    assert len(list(tmp_path.glob("*.kv"))) == 4  # nothing deleted


def test_a_decode_replica_loads_a_conversation_back_from_its_host_tier(
    tiny_llama: str, expected: Expected
) -> None:
    """The decode pool (29 pages) holds fewer than three conversations; with a host tier the
    second turns find their documents there and read only the rest from the prefill replica."""
    tiers = KVOffloadConfig(cpu_gb=pages_gb(tiny_llama, 100))
    _, decode = disaggregated_turns(
        EngineConfig(model=tiny_llama, page_size=4),
        EngineConfig(model=tiny_llama, **POOL, kv_offload=tiers),
        expected,
    )
    assert decode.kv_host_hit_tokens >= 40 * 3 and decode.num_recomputed == 0
    assert decode.kv_pages_reused >= 10 * 3  # the documents' pages, not read again


def test_a_failed_load_is_computed_instead_and_its_files_forgotten(
    tiny_llama: str, expected: Expected, tmp_path: Path
) -> None:
    llm = LLM(tiny_llama, **POOL, kv_offload=disk_tiers(tiny_llama, 4, tmp_path))
    assert [o.token_ids for o in llm.generate(TURN1, GREEDY)] == expected[0]
    tiers = llm.engine.kv.tiers
    assert tiers is not None and tiers.disk is not None
    tiers.flush()
    before = dict(tiers.disk.entries)
    for path in tmp_path.glob("*.kv"):
        path.unlink()  # another replica sharing the directory deleted them
    second = llm.generate(TURN2, GREEDY)
    assert [o.token_ids for o in second] == expected[1]
    assert llm.engine.stats().kv_disk_hit_tokens > 0  # tried, failed, computed
    # the pages that failed were forgotten (a page computed again may go down anew: a new entry)
    assert any(tiers.disk.entries.get(name) is not entry for name, entry in before.items())
    drain_and_check_released(llm.engine)


def test_two_tp_ranks_keep_their_shards_in_their_own_tiers(
    ray_cluster: None, tiny_llama: str, expected: Expected, tmp_path: Path
) -> None:
    """TP=2 over gloo (rank 1 a Ray actor): rank 1 replays rank 0's spills, demotions and loads
    on its own shard, host rows and page files; the tokens are the single rank's."""
    llm = LLM(tiny_llama, **POOL, tensor_parallel_size=2,
              kv_offload=disk_tiers(tiny_llama, 6, tmp_path))  # fmt: skip
    try:
        cached = two_turns(llm, expected)
        stats = llm.engine.stats()
        assert all(c == 40 for c in cached), cached
        # rank 1's files hold what its host rows got from its pool: wrong bytes, wrong tokens
        assert stats.kv_disk_hit_tokens >= 40 * 3
        assert llm.engine.kv.tiers is not None
        llm.engine.kv.tiers.flush()
        ranks = {p.name.split("-")[0] for p in tmp_path.iterdir()}
        assert len(ranks) == 2  # each rank's files under its own name
        drain_and_check_released(llm.engine)
    finally:
        llm.close()


def test_a_prefix_loads_back_in_one_copy_and_byte_exact() -> None:
    """A prefix spilled deepest page first gets ascending host rows, so its load into ascending
    device pages is one copy (a run); the bytes come back as they went down."""
    import torch

    from workers.kvcache.tiers.data import HOST, TierData, _runs
    from workers.kvcache.tiers.offloader import OnloadJob, TieredStore

    pool = torch.arange(16 * 8, dtype=torch.uint8).view(16, 8)  # 16 pages of 8 bytes
    store = TieredStore(TierData(pool, host_rows=6, files=None), page_size=2, disk_gb=None)
    tokens = list(range(8))
    names = [hash((0, 0, 1))]
    for i in range(1, 4):
        names.append(hash((names[-1], *tokens[2 * i : 2 * i + 2])))
    store.spill([3, 4, 5, 6], names, tokens, 0, None)
    found = store.lookup(tokens, 0, 4, 0)
    assert [e.slot for _, e in found] == [2, 3, 4, 5] and {t for t, _ in found} == {HOST}
    rows = [(page, store.data.rows, e.slot) for page, (_, e) in zip(range(10, 14), found)]
    assert _runs(rows) == [(10, store.data.rows, 2, 4)]
    store.pin(found)
    store.start(OnloadJob(None, None, tokens, [], [10, 11, 12, 13], found))
    store.flush()
    assert [job.error for job in store.poll()] == [None]
    assert torch.equal(pool[10:14], pool[3:7])


def test_a_failed_load_ends_only_after_the_copies_it_queued(tmp_path: Path) -> None:
    """A failed load's pages are freed when it is polled, so none of its copies may still be
    queued then: on a GPU the load stream is synchronised before the failure is reported (a
    stand-in stream here; the file is missing)."""
    import torch

    from workers.kvcache.tiers.data import DISK, LoadOp, TierData
    from workers.kvcache.tiers.disk import PageFiles
    from workers.kvcache.tiers.index import TierEntry

    class Stream:
        synced = 0

        def synchronize(self) -> None:
            self.synced += 1

    data = TierData(torch.zeros(4, 8, dtype=torch.uint8), 2, PageFiles(str(tmp_path), 8, {}))
    data._load = stream = Stream()  # type: ignore[assignment]
    data.apply([LoadOp(0, ((1, DISK, TierEntry(5, 0, (1, 2))),))])
    data.flush()
    [result] = data.finished()[0].values()
    assert result.error is not None and stream.synced == 1
