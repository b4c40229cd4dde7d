"""Shared fixtures: the embedded SmolLM2, HF reference models, tiny random-weight checkpoints."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.config import DEFAULT_MODEL
from workers.model.files import resolve_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Modules that start Ray through its CLI (and `ray stop` it) run first; modules on the shared
    # cluster (`ray_cluster`) last, so that no other test runs in a process connected to Ray
    # (code that finds Ray, such as the stats board or the fault hook, uses it). Of those, the
    # modules on the test run's shared Serve applications (tests/e2e/conftest.py) run last, the
    # vLLM-named one's last of all: an application deployed idles at ~0.1 CPU core (its routers
    # poll), so each is started for the modules that use it, at the end. A stable sort keeps
    # every other order.
    def uses(name: str) -> set[Any]:
        return {item.module for item in items if name in item.fixturenames}

    on_cluster, shared, vllm = uses("ray_cluster"), uses("_local_apps"), uses("vllm_app")
    items.sort(key=lambda item: 0 if "own_ray" in item.keywords else
               1 if item.module not in on_cluster else
               4 if item.module in vllm else 3 if item.module in shared else 2)  # fmt: skip
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


REPO = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model(DEFAULT_MODEL)


# Logical CPUs of the shared cluster's head: enough for the actors and Serve apps that modules
# keep side by side (each module frees what it started); the machine's cores are shared either way.
RAY_CPUS = 16
# The worker nodes: custom resource naming the node type -> logical CPUs. The shared
# disaggregated app pins its prefill pool to one and its decode pool to the other, so its KV
# hand-offs cross nodes.
PREFILL_NODE, DECODE_NODE = "pd_prefill_node", "pd_decode_node"
WORKER_NODES = {PREFILL_NODE: 4, DECODE_NODE: 4}


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One Ray cluster for the whole run, of three nodes on this machine (`tests/ray_nodes.py`:
    a head and the two WORKER_NODES, started through Ray's CLI), whose workers import this
    checkout. Starting and stopping it costs ~20 s on 2 cores (one node in-process: ~10 s)."""
    import ray

    from router.routing.kv_feed import close_feeds
    from tests.ray_nodes import LocalCluster

    cluster = LocalCluster(RAY_CPUS, WORKER_NODES)
    try:
        address = cluster.start()
        path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
        ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": path}})
        cluster.wait_alive()
        yield
    finally:
        # routers that tests' handles made in this process read KV events on threads of their own
        close_feeds()
        ray.shutdown()
        cluster.stop()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> str:
    """A random Llama of 4 query and 2 KV heads (splits over 2 ranks), SmolLM2's tokenizer."""
    tmp = tmp_path_factory.mktemp("tiny-llama")
    return str(make_random_checkpoint(tmp, smollm2_dir, "LlamaForCausalLM"))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir: Path):  # noqa: ANN201 - a transformers model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()


def hf_greedy(
    model,  # noqa: ANN001 - a transformers model
    prompt: list[int],
    max_new_tokens: int,
    processors=None,  # noqa: ANN001 - a transformers LogitsProcessorList
) -> list[int]:
    """HF transformers' greedy tokens for one prompt (`hf_greedy_batch`)."""
    return hf_greedy_batch(model, [prompt], max_new_tokens, processors)[0]


def hf_greedy_batch(
    model,  # noqa: ANN001 - a transformers model
    prompts: list[list[int]],
    max_new_tokens: int,
    processors=None,  # noqa: ANN001 - a transformers LogitsProcessorList
) -> list[list[int]]:
    """HF transformers' greedy tokens with its own KV cache on the model's device, never
    stopping at EOS; with `processors` (a `LogitsProcessorList`, given each row's own tokens)
    the argmax is of the logits they return. The prompts run as one left-padded batch (an
    attention mask, positions counted from each row's first token): a step per token, not a
    step per token and prompt."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    mask = torch.tensor([[0] * n + [1] * len(p) for n, p in zip(pads, prompts)], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids = torch.tensor([[0] * n + p for n, p in zip(pads, prompts)], device=device)
    rows = [list(p) for p in prompts]
    with torch.inference_mode():
        out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
        for _ in range(max_new_tokens):
            scores = out.logits[:, -1].float()
            if processors is not None:
                scores = torch.cat([
                    processors(torch.tensor([row], device=device), scores[i : i + 1])
                    for i, row in enumerate(rows)
                ])  # fmt: skip
            picked = scores.argmax(-1)
            for row, token in zip(rows, picked.tolist()):
                row.append(token)
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            positions = positions[:, -1:] + 1
            # the cache goes fourth: transformers 5 renamed `past_key_values` (input and output)
            # to `cache`, and deprecated the old name
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            out = model(picked[:, None], mask, positions, cache, use_cache=True)
    return [row[len(p) :] for row, p in zip(rows, prompts)]


def make_random_checkpoint(
    tmp_dir: Path, tokenizer_dir: Path, architecture: str, **overrides: object
) -> Path:
    """A tiny random-weight HF checkpoint (safetensors) with SmolLM2's tokenizer files."""
    import transformers

    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    from bench.gpu_common import SHAPES

    # a 512-token context, as the tests' limits expect
    shape = dict(SHAPES["tiny-llama"][1], max_position_embeddings=512, architectures=[architecture])
    config = config_cls(**{**shape, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    model.save_pretrained(tmp_dir, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, tmp_dir / f.name)
    return tmp_dir


@functools.cache
def _smollm2_vocabulary() -> dict[str, tuple[Any, Any, Any]]:
    """The embedded SmolLM2 GGUF's `tokenizer.*` fields: name -> (value, type, array item type)."""
    from gguf import GGUFReader

    from workers.model.files import _embedded_gguf

    fields = GGUFReader(_embedded_gguf(DEFAULT_MODEL)).fields
    return {
        name: (f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
        for name, f in fields.items()
        if name.startswith("tokenizer.")
    }


def make_random_moe_gguf(
    path: Path, *, arch: str = "qwen3moe", hidden: int = 64, layers: int = 2, experts: int = 8,
    top_k: int = 2, expert_size: int = 32, shared_size: int = 48, heads: int = 4,
    kv_heads: int = 2, head_dim: int = 16, seed: int = 0,
) -> Path:  # fmt: skip
    """A tiny random Qwen3-MoE (`arch` "qwen3moe": q/k norms) or Qwen2-MoE ("qwen2moe": q/k/v
    biases, a gated shared expert `shared_size` wide) written as llama.cpp writes one to GGUF
    (its tensor names and metadata keys, float32 tensors) with SmolLM2's vocabulary (49152
    tokens: its GGUF's `tokenizer.*` fields). Tensors are in torch's orientation, `[out, in]` and
    the experts stacked `[E, out, in]` (GGUF's shape lists the dimensions reversed); q and k are
    not permuted (llama.cpp permutes them for `llama`'s rotary layout only, and transformers
    un-permutes only that architecture). Weights are N(0, 1/fan_in) and the norms' 1 + N(0, 0.01),
    so every matrix, the router included, moves the greedy tokens."""
    import numpy as np
    from gguf import GGUFWriter, LlamaFileType

    vocab = _smollm2_vocabulary()
    vocab_size = len(vocab["tokenizer.ggml.tokens"][0])
    rng = np.random.default_rng(seed)

    def linear(out: int, inp: int, *stack: int) -> Any:
        return (rng.standard_normal((*stack, out, inp)) / inp**0.5).astype(np.float32)

    def norm(n: int) -> Any:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    qwen2 = arch == "qwen2moe"
    w = GGUFWriter(path, arch)
    w.add_name(f"tiny-random-{arch}")
    w.add_file_type(LlamaFileType.ALL_F32)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(3 * hidden)  # a dense MLP's width: no layer of this model has one
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(experts)
    w.add_expert_used_count(top_k)
    w.add_expert_feed_forward_length(expert_size)
    if qwen2:
        w.add_expert_shared_feed_forward_length(shared_size)
    w.add_vocab_size(vocab_size)
    for name, (value, kind, item_kind) in vocab.items():
        w.add_key_value(name, value, kind, item_kind)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab_size, hidden)).astype(np.float32))
    for i in range(layers):
        blk = f"blk.{i}."
        w.add_tensor(blk + "attn_norm.weight", norm(hidden))
        w.add_tensor(blk + "attn_q.weight", linear(heads * head_dim, hidden))
        w.add_tensor(blk + "attn_k.weight", linear(kv_heads * head_dim, hidden))
        w.add_tensor(blk + "attn_v.weight", linear(kv_heads * head_dim, hidden))
        w.add_tensor(blk + "attn_output.weight", linear(hidden, heads * head_dim))
        if qwen2:
            for part, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                bias = 0.1 * rng.standard_normal(n * head_dim)
                w.add_tensor(blk + f"attn_{part}.bias", bias.astype(np.float32))
            w.add_tensor(blk + "ffn_gate_inp_shexp.weight", linear(1, hidden)[0])
            w.add_tensor(blk + "ffn_gate_shexp.weight", linear(shared_size, hidden))
            w.add_tensor(blk + "ffn_up_shexp.weight", linear(shared_size, hidden))
            w.add_tensor(blk + "ffn_down_shexp.weight", linear(hidden, shared_size))
        else:
            w.add_tensor(blk + "attn_q_norm.weight", norm(head_dim))
            w.add_tensor(blk + "attn_k_norm.weight", norm(head_dim))
        w.add_tensor(blk + "ffn_norm.weight", norm(hidden))
        w.add_tensor(blk + "ffn_gate_inp.weight", linear(experts, hidden))  # the router
        w.add_tensor(blk + "ffn_gate_exps.weight", linear(expert_size, hidden, experts))
        w.add_tensor(blk + "ffn_up_exps.weight", linear(expert_size, hidden, experts))
        w.add_tensor(blk + "ffn_down_exps.weight", linear(hidden, expert_size, experts))
    w.add_tensor("output_norm.weight", norm(hidden))
    w.add_tensor("output.weight", linear(vocab_size, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
