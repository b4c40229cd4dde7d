"""Weights in blocks of rows (`kernels.blocked_weights`): the layout, F.linear over it, and a model
whose gate/up weights are blocked keeping HF's greedy tokens (CPU; the skinny GEMM's reads of a
blocked weight: test_skinny_gemm_interpreted.py and tests/gpu/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import hf_greedy, make_random_checkpoint
from tests.tolerance import dot_scale, reduction_atol
from workers import LLM, SamplingParams
from workers.config import KernelConfig
from workers.kernels.weight_blocks import BLOCK_ROWS, block_rows, blocked_linear, rows_per_block
from workers.model.layers import linear, silu_and_mul_linear


@pytest.mark.parametrize("block", [2, 32, 128])
def test_a_blocked_weight_holds_each_block_transposed(block: int) -> None:
    w = torch.randn(256, 96, generator=torch.Generator().manual_seed(block))
    blocked = w.clone()
    block_rows(blocked, block)
    assert rows_per_block(blocked) == block and rows_per_block(w) == 1
    assert blocked.shape == w.shape
    b = 256 // block - 1  # the last block: rows [b * block, 256), stored [96, block]
    assert torch.equal(blocked.view(-1, 96, block)[b], w[b * block :].t())


@pytest.mark.parametrize("x_shape", [(1, 96), (7, 96), (2, 5, 96)])
def test_linear_over_a_blocked_weight_is_f_linear(x_shape: tuple[int, ...]) -> None:
    """The batched GEMM sums in another order than F.linear: equal within a float32 reduction's
    rounding over K = 96 (a block in the wrong place or a transposed one is off by O(1))."""
    gen = torch.Generator().manual_seed(len(x_shape) * 100 + x_shape[0])
    w, bias = torch.randn(256, 96, generator=gen), torch.randn(256, generator=gen)
    x = torch.randn(x_shape, generator=gen)
    blocked = w.clone()
    block_rows(blocked, 32)
    atol = reduction_atol(96, dot_scale(x.reshape(-1, 96), w))
    expect = F.linear(x, w)
    torch.testing.assert_close(blocked_linear(x, blocked), expect, atol=atol, rtol=0)
    torch.testing.assert_close(linear(x, blocked, bias), expect + bias, atol=atol, rtol=0)
    gate, up = expect.chunk(2, dim=-1)
    # A product of two sums each within atol: |up| * atol + |silu'(gate)| (< 1.1) * |gate| * atol.
    atol_gated = atol * float(up.abs().max() + 1.1 * gate.abs().max())
    torch.testing.assert_close(
        silu_and_mul_linear(x, blocked), F.silu(gate) * up, atol=atol_gated, rtol=0
    )


def test_block_rows_refuses_what_it_cannot_block() -> None:
    with pytest.raises(ValueError, match="divisible by 128"):
        block_rows(torch.zeros(200, 64))
    w = torch.zeros(256, 64)
    block_rows(w)
    with pytest.raises(ValueError, match="row-major"):
        block_rows(w)  # twice


def test_blocked_gate_up_keeps_hfs_greedy_tokens(tmp_path: Path, smollm2_dir: Path) -> None:
    import transformers

    ckpt = make_random_checkpoint(tmp_path, smollm2_dir, "LlamaForCausalLM")
    hf = transformers.LlamaForCausalLM.from_pretrained(ckpt).eval()
    prompts = [[(11 * i + 7 * j) % 3000 + 9 for j in range(3 + 8 * i)] for i in range(3)]
    expected = [hf_greedy(hf, p, 10) for p in prompts]
    llm = LLM(str(ckpt), kernels=KernelConfig(blocked_weights=True))
    for layer in llm.engine.runner.model.decoder_layers:
        assert rows_per_block(layer.mlp.gate_up_proj.weight) == BLOCK_ROWS
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_blocked_weights_name_the_rows_they_need(tmp_path: Path, smollm2_dir: Path) -> None:
    ckpt = make_random_checkpoint(tmp_path, smollm2_dir, "LlamaForCausalLM", intermediate_size=96)
    with pytest.raises(ValueError, match=r"gate/up rows of a rank \(96\) divisible by 128"):
        LLM(str(ckpt), kernels=KernelConfig(blocked_weights=True))
