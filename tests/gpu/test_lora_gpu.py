"""LoRA on a GPU (SmolLM2, real weights): in float32 the mixed batch's greedy tokens equal HF
PEFT's on the GPU; in bf16, where the norm gains are folded into the weights at load, a LoRA step
(unfolded, the gains folded into A too) gives the tokens the unfolded model gives; a LoRA decode
step replays its size's LoRA CUDA graph and gives the eager LoRA path's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import hf_greedy_batch
from tests.gpu.conftest import record_replays
from tests.lora_adapters import ALL_MODULES, make_lora_adapter, peft_model
from workers import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> list[LoRARequest]:
    tmp = tmp_path_factory.mktemp("gpu-loras")
    a = make_lora_adapter(smollm2_dir, tmp / "a", 8, 16, ALL_MODULES, seed=1)
    b = make_lora_adapter(smollm2_dir, tmp / "b", 4, 8, ["q_proj", "v_proj", "down_proj"], seed=2,
                          rslora=True)  # fmt: skip
    return [
        LoRARequest(lora_name="a", lora_int_id=1, lora_path=str(a)),
        LoRARequest(lora_name="b", lora_int_id=2, lora_path=str(b)),
    ]


def _batch(llm: LLM, adapters: list[LoRARequest]) -> tuple[list[list[int]], list]:
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    loras = [None, *adapters] * len(prompts)
    return [p for p in prompts for _ in range(3)], loras


def test_float32_mixed_batch_equals_peft(adapters, smollm2_dir: Path) -> None:
    llm = LLM(device="cuda", dtype="float32", attention_backend="torch", enable_lora=True,
              max_loras=2, max_lora_rank=8)  # fmt: skip
    batch, loras = _batch(llm, adapters)
    outs = llm.generate(batch, GREEDY, lora_request=loras)
    prompts = batch[::3]
    refs = {}
    for lora in [None, *adapters]:
        from transformers import AutoModelForCausalLM

        model = (
            AutoModelForCausalLM.from_pretrained(smollm2_dir)
            if lora is None
            else peft_model(smollm2_dir, Path(lora.lora_path))
        )
        refs[None if lora is None else lora.lora_name] = hf_greedy_batch(
            model.float().cuda().eval(), prompts, NEW_TOKENS
        )
    for i, (out, lora) in enumerate(zip(outs, loras)):
        name = None if lora is None else lora.lora_name
        assert out.token_ids == refs[name][i // 3], f"prompt {i // 3} under {name}"


def test_bf16_lora_steps_see_the_folded_gains(adapters) -> None:
    folded = LLM(device="cuda", enable_lora=True, max_loras=2, max_lora_rank=8)
    if not folded.engine.runner.model.norms_folded:
        pytest.skip("this GPU's skinny GEMM does not take SmolLM2's decode: nothing is folded")
    plain = LLM(device="cuda", enable_lora=True, max_loras=2, max_lora_rank=8,
                kernels={"fold_norms": False})  # fmt: skip
    few = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    batch, loras = _batch(folded, adapters)
    got = [o.token_ids for o in folded.generate(batch, few, lora_request=loras)]
    want = [o.token_ids for o in plain.generate(batch, few, lora_request=loras)]
    assert got == want
    base = [o.token_ids for o in folded.generate(batch, few)]
    assert [g for g, lora in zip(got, loras) if lora] != [b for b, lora in zip(base, loras) if lora]


@pytest.mark.parametrize("products", ["after", "beside"])
def test_lora_decode_steps_replay_a_graph_with_the_eager_tokens(
    adapters, smollm2_dir: Path, products: str
) -> None:
    """The mixed batch's decode steps (9 rows, padded to 16: the padding rows base rows) replay
    the LoRA graph with the step's slot mask, and give the eager LoRA path's greedy tokens, with
    the products after their base GEMMs or beside them on a second stream (a branch of the
    graph); a batch of base requests only replays the base graph."""
    kw = dict(device="cuda", enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory_gb=1,
              kernels={"lora_products": products})  # fmt: skip
    graphed = LLM(str(smollm2_dir), cuda_graph_batch_sizes=(16,), **kw)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.has_lora
    replays: list[tuple[int, bool]] = []  # (rows, with a slot mask)
    record_replays(
        graphs, lambda batch, mask: replays.append((len(batch.q_lens), mask is not None))
    )
    batch, loras = _batch(graphed, adapters)
    got = [o.token_ids for o in graphed.generate(batch, GREEDY, lora_request=loras)]
    assert replays == [(16, True)] * (NEW_TOKENS - 1)  # the prompts' step runs eagerly
    replays.clear()
    graphed.generate(batch, GREEDY)
    assert set(replays) == {(16, False)}  # cached prompts may replay from their first step
    del graphed
    eager = LLM(str(smollm2_dir), enforce_eager=True, **kw)
    assert eager.engine.runner.graphs is None
    want = [o.token_ids for o in eager.generate(batch, GREEDY, lora_request=loras)]
    assert got == want


def test_products_beside_or_in_the_gemm_epilogue_give_the_after_path_tokens(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """`kernels.lora_products="epilogue"` (the expand inside the folded path's skinny GEMMs,
    q/k/v rotated there too) and "beside" (the SGMV launches on a second stream, q/k/v's
    products added by the rotary kernel) against "after" (the SGMV launches after each GEMM),
    Llama-3-8B's shapes (those of the GPU's skinny GEMM table) with random bf16 weights and
    CUDA graphs, a batch of 16 mixing two adapters of rank 16 and base rows: each request's
    first tokens equal unless the "after" run's top two were within bf16 noise, top-1
    log-probs close; the adapters change the log-probs. Without the folded path (no skinny
    GEMM table for the GPU) "epilogue" runs as "after" and is not compared."""
    from bench.bench_lora import write_adapter
    from bench.gpu_common import dummy_model_dir
    from workers.model.files import load_model_config

    model = dummy_model_dir("llama3-8b", tokenizer_dir, tmp_path)
    shapes = load_model_config(model)
    loras = [LoRARequest(lora_name=f"e{i}", lora_int_id=i + 1,
                         lora_path=str(write_adapter(tmp_path / f"e{i}", shapes, 16, i)))
             for i in range(2)]  # fmt: skip
    kw = dict(device="cuda", load_format="dummy", enable_lora=True, max_loras=2,
              max_lora_rank=16, num_kv_pages=128, max_num_seqs=16,
              cuda_graph_batch_sizes=(16,))  # fmt: skip
    prompts = [[(13 * j + 7 * i) % 4000 + 5 for j in range(20 + 3 * i)] for i in range(16)]
    which = [None, *loras] * 5 + [None]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    runs, base = {}, None
    for products in ("after", "beside", "epilogue"):
        llm = LLM(str(model), kernels={"lora_products": products}, **kw)
        if products == "epilogue" and not llm.engine.runner.model.norms_folded:
            break
        runs[products] = llm.generate(prompts, params, lora_request=which)
        if products == "after":
            base = llm.generate(prompts, params)
        del llm
    assert base is not None
    for products in set(runs) - {"after"}:
        for want, got, lora in zip(runs["after"], runs[products], which):
            for w, g in zip(want.logprobs, got.logprobs):
                gap = w.logprob - min(w.top.values())
                assert g.token_id == w.token_id or gap < 0.1, (products, lora, w, g)
                assert abs(g.top.get(w.token_id, -99.0) - w.logprob) < 0.1, (products, lora, w, g)
                if g.token_id != w.token_id:
                    break  # the sequences part: later tokens see other prefixes
    changed = 0
    for want, b, lora in zip(runs["after"], base, which):
        moved = [abs(w.logprob - x.logprob) for w, x in zip(want.logprobs, b.logprobs)]
        changed += lora is not None and max(moved) > 1e-3
    assert changed > 0, "the adapters change nothing"
