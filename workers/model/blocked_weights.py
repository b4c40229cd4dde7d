"""`KernelConfig.blocked_weights`: each dense MLP's gate/up weight stored in blocks of rows
(`workers/kernels/weight_blocks.py`), after any norm folding, so that the decode GEMM's tiles
read contiguous memory."""

from __future__ import annotations

from workers.kernels.weight_blocks import BLOCK_ROWS, block_rows
from workers.model.llama import LlamaForCausalLM
from workers.model.mlp import MLP


def block_gate_up_weights(model: LlamaForCausalLM) -> None:
    """Block every dense layer's gate/up weight in place (experts are stacked and read by their
    own kernel); a clear error where a rank's gate rows do not fill whole blocks."""
    for layer in model.decoder_layers:
        if not isinstance(layer.mlp, MLP):
            continue
        weight = layer.mlp.gate_up_proj.weight
        if weight.shape[0] // 2 % BLOCK_ROWS:
            raise ValueError(
                f"blocked_weights needs the gate/up rows of a rank ({weight.shape[0] // 2}) "
                f"divisible by {BLOCK_ROWS}"
            )
        block_rows(weight)
