"""NIXL READ bandwidth between two Ray actors, against a local torch copy of the same bytes.

Two actors (prefill, decode) each hold a KV pool shaped like SmolLM2-135M (30 layers, 3 KV
heads, head_dim 64, page 16; float32 on CPU, bfloat16 with --device cuda). For each prompt
length the decode actor reads the prompt's pages from the prefill actor:
- `runs`: pages consecutive on both sides (what a fresh allocator hands out): one descriptor;
- `scattered`: remote pages shuffled, so every page is its own descriptor (the worst case).
Both transfer modes of `KVTransferAgent` are measured (`prepped` dlists, `merged` run
descriptors through `initialize_xfer`). The reference is a torch copy of the same runs between
two tensors inside the decode actor, in the same run. Every configuration is checked for
equal bytes once.

With two GPUs (`--device cuda --num-gpus 1`: one actor per GPU) the reference that matters is
the link itself: the driver also times a torch peer copy of the same runs from GPU 0 to GPU 1
(`peer_GB/s`, NVLink), and the ratio is taken against it. `--layout llama3-8b` uses that
model's KV (32 layers, 8 KV heads, head_dim 128: 2 MiB a bf16 page).

`--kv-dtypes bfloat16,float8_e4m3fn` measures each KV dtype in turn (fresh actors and pools)
and adds, per prompt length, pattern and mode, the read time and bytes against the first dtype's
(`engine.kv_cache_dtype=fp8_e4m3` moves its pages as they are: half a bf16 page's bytes); the
result is then `kv-transfer-dtypes`.

    python bench/bench_kv_transfer.py                       # CPU, DRAM
    python bench/bench_kv_transfer.py --device cuda         # GPU, VRAM (num_gpus 0.5 each)
    python bench/bench_kv_transfer.py --device cuda --num-gpus 1 --layout llama3-8b  # 2 GPUs
    python bench/bench_kv_transfer.py --kv-dtypes bfloat16,float8_e4m3fn   # FP8 against bf16
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from bench.results_io import add_out_argument, write_result  # noqa: E402
from workers.kvcache.pool import KVPool  # noqa: E402
from workers.protocol import KVLayout  # noqa: E402
from workers.transfer import KVTransferAgent, merge_page_runs  # noqa: E402

MODES = ("prepped", "merged")


class BenchWorker:
    """One rank: a pool, one transfer agent per mode over it, and a scratch pool for the copy.

    The prefill side runs `serve()`, a stand-in for its engine loop that polls notifications
    every millisecond (it progresses UCX for peers' reads; see workers/transfer/agent.py).
    """

    def __init__(
        self, role: str, layout: dict, num_pages: int, device: str, modes: list, pthread: bool
    ) -> None:
        self.device = torch.device(device)
        self.pool = KVPool(KVLayout(**layout), num_pages, self.device)
        self.agents = {
            m: KVTransferAgent(self.pool, role, "bench", 0, xfer_mode=m, progress_thread=pthread)
            for m in modes
        }
        self.scratch: torch.Tensor | None = None

    def names(self) -> dict[str, str]:
        return {m: a.name for m, a in self.agents.items()}

    def serve(self) -> None:
        while True:
            for a in self.agents.values():
                a.get_notifs()
            time.sleep(0.001)

    def fill(self, seed: int) -> None:
        g = torch.Generator(device=self.device).manual_seed(seed)
        p = self.pool.pages
        p.copy_(torch.randn(p.shape, generator=g, device=self.device, dtype=torch.float32))

    def digest(self, pages: list[int]) -> str:
        data = self.pool.pages.view(torch.uint8)[pages].contiguous().cpu().numpy()
        return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def read(
        self, mode: str, remote: str, rpages: list[int], lpages: list[int], iters: int
    ) -> dict:
        """`iters` timed READs after one untimed one (which may load the peer)."""
        agent = self.agents[mode]
        times, makes, posts, first = [], [], [], 0.0
        for i in range(iters + 1):
            self._sync()
            t0 = time.perf_counter()
            h = agent.read_pages(remote, rpages, lpages)
            t1 = time.perf_counter()
            while agent.poll(h) == "PROC":
                pass
            t2 = time.perf_counter()
            agent.release(h)
            if h.state != "DONE":
                raise RuntimeError(f"READ ended {h.state}")
            if i == 0:
                first = t2 - t0
                continue
            times.append(t2 - t0)
            makes.append(h.posted_at - t0)  # page checks, descriptors, NIXL request
            posts.append(t1 - h.posted_at)  # transfer(): on cma it copies part of the bytes
        med = statistics.median
        return {
            "times": times,
            "make_s": med(makes),
            "post_s": med(posts),
            "first_s": first,
            "descs": h.num_descriptors,
        }

    def torch_copy(self, rpages: list[int], lpages: list[int], iters: int) -> list[float]:
        """The same runs copied between two tensors of this process (src: a scratch pool)."""
        if self.scratch is None:
            self.scratch = self.pool.pages.clone()
        dst, src, times = self.pool.pages, self.scratch, []
        runs = merge_page_runs(lpages, rpages)
        for _ in range(iters + 1):
            self._sync()
            t0 = time.perf_counter()
            for r in runs:
                dst[r.local_start : r.local_start + r.length].copy_(
                    src[r.remote_start : r.remote_start + r.length]
                )
            self._sync()
            times.append(time.perf_counter() - t0)
        return times[1:]


LAYOUTS = {"smollm2": (30, 3, 64), "llama3-8b": (32, 8, 128)}  # layers, KV heads, head_dim


def peer_copy_times(
    layout: KVLayout, num_pages: int, rpages: list[int], lpages: list[int], iters: int
) -> list[float]:
    """The same runs copied by torch from a pool on GPU 0 into one on GPU 1 (this process)."""
    shape = (num_pages, layout.page_bytes)  # bytes, whatever the KV dtype
    src = torch.randint(0, 256, shape, device="cuda:0", dtype=torch.uint8)
    dst = torch.empty(shape, device="cuda:1", dtype=torch.uint8)
    runs = merge_page_runs(lpages, rpages)
    times = []
    for _ in range(iters + 1):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        t0 = time.perf_counter()
        for r in runs:
            dst[r.local_start : r.local_start + r.length].copy_(
                src[r.remote_start : r.remote_start + r.length], non_blocking=True
            )
        torch.cuda.synchronize("cuda:1")
        torch.cuda.synchronize("cuda:0")
        times.append(time.perf_counter() - t0)
    return times[1:]


def page_lists(n: int, pattern: str, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """(remote pages, local pages) for an n-page prompt; page 0 is the scratch page."""
    local = list(range(1, n + 1))
    remote = list(range(1, n + 1))
    if pattern == "scattered":
        remote = (rng.permutation(n) + 1).tolist()
    return remote, local


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--patterns", default="runs,scattered")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--num-gpus", type=float, default=0.5, help="per actor, with --device cuda")
    ap.add_argument("--progress-thread", action="store_true", help="NIXL's (spinning) thread")
    add_out_argument(ap)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="smollm2")
    ap.add_argument("--kv-dtypes", help="KV dtypes to compare, e.g. bfloat16,float8_e4m3fn; "
                    "default: float32 on CPU, bfloat16 on a GPU")  # fmt: skip
    args = ap.parse_args()

    tokens = [int(t) for t in args.tokens.split(",")]
    default = "float32" if args.device == "cpu" else "bfloat16"
    dtypes = (args.kv_dtypes or default).split(",")
    ray.init(
        num_cpus=max(2, os.cpu_count() or 2),
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
            }
        },
    )
    rows = []
    for kv_dtype in dtypes:
        rows += measure(args, tokens, kv_dtype)
    ray.shutdown()
    name, what = "kv-transfer", f"{dtypes[0]}"
    if len(dtypes) > 1:
        name, what = "kv-transfer-dtypes", " against ".join(reversed(dtypes))
        key = ("tokens", "pattern", "mode")
        first = {tuple(r[k] for k in key): r for r in rows if r["kv_dtype"] == dtypes[0]}
        for r in rows:
            base = first[tuple(r[k] for k in key)]
            r["bytes_vs_first"] = round(r["MiB"] / base["MiB"], 3)
            r["time_vs_first"] = round(r["read_ms"] / base["read_ms"], 3)
            print(f"{r['kv_dtype']:>14} {r['tokens']:>6} {r['pattern']:>9} {r['mode']:>7} "
                  f"{r['MiB']:>6.2f} MiB {r['read_ms']:>7.3f} ms: bytes x{r['bytes_vs_first']}, "
                  f"time x{r['time_vs_first']} of {dtypes[0]}")  # fmt: skip
    model = f"{args.layout} KV layout ({what}, page 16), NIXL READ, median of {args.iters}"
    write_result(args.out, name, rows, model=model)


def measure(args: argparse.Namespace, tokens: list[int], kv_dtype: str) -> list[dict]:
    """Every prompt length, pattern and mode, between a fresh prefill and decode actor."""
    layers, kv_heads, head_dim = LAYOUTS[args.layout]
    layout = KVLayout(
        num_layers=layers,
        page_size=16,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=kv_dtype,
    )
    peer = args.device == "cuda" and torch.cuda.device_count() >= 2 and args.num_gpus >= 1
    num_pages = max(tokens) // layout.page_size + 2
    gpus = args.num_gpus if args.device == "cuda" else 0
    actor = ray.remote(num_cpus=0, num_gpus=gpus, max_concurrency=2)(BenchWorker)
    pt = args.progress_thread
    prefill = actor.remote("prefill", layout.model_dump(), num_pages, args.device, ["prepped"], pt)
    decode = actor.remote("decode", layout.model_dump(), num_pages, args.device, list(MODES), pt)
    prefill_name = ray.get(prefill.names.remote())["prepped"]
    prefill.serve.remote()
    ray.get([prefill.fill.remote(1), decode.fill.remote(2)])
    print(
        f"layout {layout.model_dump()}  page_bytes {layout.page_bytes}  pool {num_pages} pages "
        f"({num_pages * layout.page_bytes / 2**20:.0f} MiB) on {args.device}; "
        f"median of {args.iters} reads; progress thread {'on' if pt else 'off'}; reference: "
        f"{'torch peer copy GPU 0 -> GPU 1' if peer else 'torch copy inside the decode actor'}"
    )

    rng = np.random.default_rng(0)
    rows = []
    head = (
        f"{'tokens':>6} {'pattern':>9} {'mode':>7} {'MiB':>6} {'descs':>5} {'make_us':>7} "
        f"{'post_ms':>7} {'first_ms':>8} {'nixl_GB/s':>9} {'best':>5} {'torch_GB/s':>10} "
        f"{'ratio':>5}"
    )
    print(head)
    print("-" * len(head))
    for n_tok in tokens:
        n = -(-n_tok // layout.page_size)
        nbytes = n * layout.page_bytes
        for pattern in args.patterns.split(","):
            rpages, lpages = page_lists(n, pattern, rng)
            if peer:  # the link between the two GPUs
                copy_times = peer_copy_times(layout, num_pages, rpages, lpages, args.iters)
            else:  # a copy inside the decode actor's device
                copy_times = ray.get(decode.torch_copy.remote(rpages, lpages, args.iters))
            torch_gbps = nbytes / statistics.median(copy_times) / 1e9
            for mode in MODES:
                ray.get(decode.fill.remote(3))  # overwrite, so the check sees this mode's read
                r = ray.get(decode.read.remote(mode, prefill_name, rpages, lpages, args.iters))
                same = ray.get(prefill.digest.remote(rpages)) == ray.get(
                    decode.digest.remote(lpages)
                )
                if not same:
                    raise SystemExit(f"bytes differ after READ: {n_tok} {pattern} {mode}")
                gbps = nbytes / statistics.median(r["times"]) / 1e9
                best = nbytes / min(r["times"]) / 1e9
                row = {
                    "kv_dtype": kv_dtype,
                    "tokens": n_tok,
                    "pattern": pattern,
                    "mode": mode,
                    "pages": n,
                    "MiB": nbytes / 2**20,
                    "descs": r["descs"],
                    "make_us": 1e6 * r["make_s"],
                    "post_ms": 1e3 * r["post_s"],
                    "first_ms": 1e3 * r["first_s"],
                    "read_ms": 1e3 * statistics.median(r["times"]),
                    "nixl_GBps": gbps,
                    "best_GBps": best,
                    "torch_GBps": torch_gbps,
                    "ratio": gbps / torch_gbps,
                }
                print(
                    f"{n_tok:>6} {pattern:>9} {mode:>7} {row['MiB']:>6.1f} {r['descs']:>5} "
                    f"{row['make_us']:>7.0f} {row['post_ms']:>7.2f} {row['first_ms']:>8.1f} "
                    f"{gbps:>9.2f} {best:>5.2f} {torch_gbps:>10.2f} {row['ratio']:>5.2f}"
                )
                rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    ray.kill(prefill)
    ray.kill(decode)
    return rows


if __name__ == "__main__":
    main()
