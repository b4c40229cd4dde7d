"""Structured outputs on CUDA (SmolLM2's real weights, bf16, FlashInfer, CUDA graphs, overlap
scheduling): a batch with JSON-schema, regex and unconstrained rows side by side gives valid
outputs, the mask taking the graph's logits; random weights (nearly flat logits, so the mask
decides every token) too."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from workers import LLM, SamplingParams
from workers.protocol import StructuredOutputs

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[0-9]{4}"
ENGINE = dict(device="cuda", dtype="bfloat16", kv_cache_memory_gb=1, page_size=16)


def check_batch(llm: LLM) -> None:
    prompts = [f"Person {i} as JSON:" for i in range(24)] + ["A phone number:", "Hello"]
    json_params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=120,
                       structured_outputs=StructuredOutputs(json_schema=SCHEMA))
        for i in range(24)
    ]  # fmt: skip
    params = json_params + [
        SamplingParams(temperature=0.0, max_tokens=20,
                       structured_outputs=StructuredOutputs(regex=REGEX)),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    ]  # fmt: skip
    outs = llm.generate(prompts, params)
    for out in outs[:24]:
        assert out.finish_reason == "stop", (out.text, out.error)
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert re.fullmatch(REGEX, outs[24].text) and outs[24].finish_reason == "stop"
    assert len(outs[25].token_ids) == 20  # the unconstrained row is untouched


def test_a_constrained_batch_on_cuda_gives_valid_json(smollm2_dir: Path) -> None:
    llm = LLM(str(smollm2_dir), attention_backend="flashinfer", **ENGINE)
    assert llm.engine.runner.graphs is not None and llm.engine.overlap
    check_batch(llm)


def test_random_weights_still_give_valid_json(smollm2_random: Path) -> None:
    check_batch(LLM(str(smollm2_random), **ENGINE))


@pytest.mark.parametrize("vocab, mask_vocab, rows", [(128256, 49152, 64), (49152, 49152, 3)])
def test_the_triton_bitmask_kernel_blocks_what_the_torch_form_blocks(
    vocab: int, mask_vocab: int, rows: int
) -> None:
    """Every row masked, or a few rows of a wider batch; logits wider than the bitmask."""
    import torch

    from workers.sampling.token_mask import apply_bitmask, bitmask_words

    gen = torch.Generator().manual_seed(0)
    batch = max(rows, 8)
    logits = torch.randn(batch, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, bitmask_words(mask_vocab)),
                            dtype=torch.int32, generator=gen)  # fmt: skip
    row_ids = torch.arange(rows) if rows == batch else torch.tensor([1, 4, 6])
    want = logits.clone()
    apply_bitmask(want, bitmask, row_ids)  # the CPU's torch form
    got = logits.cuda()
    apply_bitmask(got, bitmask.cuda(), row_ids.cuda())
    assert torch.equal(got.cpu(), want)
    assert torch.isinf(want[row_ids, mask_vocab:]).all()
