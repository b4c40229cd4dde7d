"""vLLM's `cache_salt`: requests share prefix-cache pages only with requests of the same salt
(and adapter): the cache ids (`prefix_cache_ids`) differ in their first id, inside the
adapter's range; the engine finds a salted prompt's pages only for its own salt; the routers
name its pages the same way; over HTTP an empty salt is 400."""

from __future__ import annotations

from workers import LLM
from workers.kvcache.kv_events import LORA_SALT, prefix_cache_ids
from workers.protocol import GenerateRequest, LoRARequest, SamplingParams

IDS = list(range(300, 340))


def test_a_salt_changes_the_first_id_inside_the_adapters_range() -> None:
    assert prefix_cache_ids(IDS, 0) is IDS
    a, b = prefix_cache_ids(IDS, 0, "tenant-a"), prefix_cache_ids(IDS, 0, "tenant-b")
    assert a[1:] == b[1:] == IDS[1:] and a[0] != b[0] != IDS[0]
    assert prefix_cache_ids(IDS, 0, "tenant-a") == a  # the same salt: the same ids
    assert a[0] > max(IDS) and a[0] < LORA_SALT
    on_lora = prefix_cache_ids(IDS, 3, "tenant-a")
    assert on_lora[0] // LORA_SALT == 3 and on_lora[1:] == [3 * LORA_SALT + t for t in IDS[1:]]


def _cached_tokens(llm: LLM, salt: str | None, rid: str) -> int:
    """Run IDS as one request with `salt`; the prompt tokens it found in the prefix cache."""
    params = SamplingParams(max_tokens=2, temperature=0.0)
    llm.engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=tuple(IDS),
                                           params=params, cache_salt=salt))  # fmt: skip
    cached = None
    while llm.engine.has_work():
        for out in llm.engine.step():
            cached = out.num_cached_tokens if out.num_cached_tokens else cached
    return cached or 0


def test_the_engine_shares_pages_only_within_a_salt() -> None:
    llm = LLM(num_kv_pages=64, page_size=4)
    assert _cached_tokens(llm, "tenant-a", "a1") == 0
    assert _cached_tokens(llm, "tenant-b", "b1") == 0  # the same text, another salt
    assert _cached_tokens(llm, None, "n1") == 0  # unsalted requests do not see salted pages
    assert _cached_tokens(llm, "tenant-a", "a2") >= len(IDS) - 4  # its own salt's pages
    assert _cached_tokens(llm, None, "n2") >= len(IDS) - 4


def test_the_routers_name_a_salted_prompts_pages_as_the_engines_do() -> None:
    from router.routing.policy import cache_ids

    lora = LoRARequest(lora_name="x", lora_int_id=2, lora_path="/x")
    req = GenerateRequest(request_id="r", prompt_token_ids=tuple(IDS), lora=lora,
                          cache_salt="tenant-a")  # fmt: skip
    assert list(cache_ids(req)) == list(prefix_cache_ids(IDS, 2, "tenant-a"))
