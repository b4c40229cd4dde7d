"""Heterogeneous TP hand-off: one decode rank's staged read against the direct read of equal TP.

Three Ray actors hold KV pools shaped like one model (SmolLM2-135M by default: 30 layers, 3 KV
heads, head_dim 64, page 16; float32 on CPU, bfloat16 with --device cuda): a prefill replica
at TP 1 (all heads), a prefill rank at TP N and a decode rank at TP N (heads [r*h/N, (r+1)*h/N)
of rank r = N - 1). For each prompt length the decode rank reads the prompt's pages through
`KVRead`, the engine's path, until DONE:
- `direct`: from the TP-N prefill rank (equal TP: its own heads' pages, one READ);
- `staged`: from the TP-1 prefill replica (heterogeneous TP): its whole pages, N times the
  bytes, into spare pages, then the copy of this rank's heads into place.
The ratio is staged time over direct time, measured in the same run; the bytes are checked once.

    python bench/bench_kv_staged.py                       # CPU, DRAM, SmolLM2, N = 3
    python bench/bench_kv_staged.py --device cuda --layout llama3-8b --tp 2 --decode-own-gpu

With `--decode-own-gpu` (two GPUs) the decode rank holds one GPU and both prefill actors share
the other, so every read crosses GPUs (NVLink); without it all three may share one GPU, where
UCX falls back to TCP and only the bytes, not the speed, mean anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, REPO)

import ray  # noqa: E402
import torch  # noqa: E402

from bench.bench_kv_transfer import LAYOUTS  # noqa: E402
from bench.results_io import add_out_argument, write_result  # noqa: E402
from workers.kvcache.pool import KVPool  # noqa: E402
from workers.protocol import KVLayout  # noqa: E402
from workers.transfer import KVTransferAgent  # noqa: E402
from workers.transfer.head_slices import staging_pages  # noqa: E402
from workers.transfer.kv_read import KVRead, ReadSpec  # noqa: E402


class Rank:
    """One pool and its agent. Prefill ranks `serve()` (poll notifications, as an idle engine
    loop with leased pages does); the decode rank `read()`s."""

    def __init__(self, role: str, layout: dict, num_pages: int, device: str) -> None:
        self.device = torch.device(device)
        self.pool = KVPool(KVLayout(**layout), num_pages, self.device)
        self.agent = KVTransferAgent(self.pool, role, "bench", 0)
        g = torch.Generator(device=self.device).manual_seed(zlib.crc32(role.encode()))
        pages = self.pool.pages
        pages.copy_(torch.randn(pages.shape, generator=g, device=self.device))

    def name(self) -> str:
        return self.agent.name

    def gpus(self) -> list[str]:
        return ray.get_runtime_context().get_accelerator_ids().get("GPU", [])

    def serve(self) -> None:
        while True:
            self.agent.get_notifs()
            time.sleep(0.001)

    def heads(self, pages: list[int], lo: int, hi: int) -> torch.Tensor:
        """KV heads [lo, hi) (of this pool's own numbering) of `pages`, on the CPU."""
        return self.pool.pages[pages][..., lo:hi, :].cpu()

    def read(self, spec: ReadSpec, iters: int) -> list[float]:
        """Seconds per read to DONE (the first, which loads the peer, untimed)."""
        times = []
        for _ in range(iters + 1):
            t0 = time.perf_counter()
            read = KVRead(self.agent, self.pool.pages, spec)
            while (state := read.poll()) == "PROC":
                pass
            times.append(time.perf_counter() - t0)
            read.release()
            if state != "DONE":
                raise RuntimeError(f"read ended {state}")
        return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="smollm2")
    ap.add_argument("--tp", type=int, default=3, help="decode TP (divides the KV heads)")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--num-gpus", type=float, default=0.3, help="per actor, with --device cuda")
    ap.add_argument("--decode-own-gpu", action="store_true", help="decode on a GPU of its own")
    add_out_argument(ap)
    args = ap.parse_args()
    layers, heads, head_dim = LAYOUTS[args.layout]
    if heads % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide {heads} KV heads")
    per, rank = heads // args.tp, args.tp - 1
    model = dict(
        num_layers=layers,
        page_size=16,
        head_dim=head_dim,
        dtype="float32" if args.device == "cpu" else "bfloat16",
    )
    full = KVLayout(num_kv_heads=heads, **model)  # type: ignore[arg-type]
    shard = KVLayout(num_kv_heads=per, kv_head_offset=rank * per, **model)  # type: ignore[arg-type]
    tokens = [int(t) for t in args.tokens.split(",")]
    n_max = max(tokens) // 16 + 1
    spare_max = staging_pages(n_max, full, shard)
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})  # fmt: skip
    gpus = args.num_gpus if args.device == "cuda" else 0
    decode_gpus = 1 if args.decode_own_gpu else gpus
    prefill_gpus = 0.5 if args.decode_own_gpu else gpus
    actor = ray.remote(num_cpus=0, max_concurrency=2)(Rank)
    # the decode rank first: with --decode-own-gpu it takes a whole GPU, the prefills the other
    decode = actor.options(num_gpus=decode_gpus).remote(
        "decode", shard.model_dump(), 2 * n_max + spare_max + 1, args.device
    )
    ray.get(decode.name.remote())
    prefill = actor.options(num_gpus=prefill_gpus)
    p_full = prefill.remote("prefill-tp1", full.model_dump(), n_max + 1, args.device)
    p_shard = prefill.remote("prefill-tpN", shard.model_dump(), n_max + 1, args.device)
    names = ray.get([p_full.name.remote(), p_shard.name.remote()])
    p_full.serve.remote()
    p_shard.serve.remote()
    where = ray.get([a.gpus.remote() for a in (decode, p_full, p_shard)])
    print(
        f"{args.layout} on {args.device}: decode rank {rank} of TP {args.tp} ({per} of {heads} KV "
        f"heads); page {shard.page_bytes / 2**10:.0f} KiB at TP {args.tp}, "
        f"{full.page_bytes / 2**10:.0f} KiB at TP 1; median of {args.iters} reads; GPUs of "
        f"decode, prefill TP 1, prefill TP N: {where}"
    )
    print(f"{'tokens':>6} {'kept MiB':>8} {'direct ms':>9} {'staged ms':>9} {'ratio':>5} "
          f"{'staged GB/s moved':>17}")  # fmt: skip
    rows = []
    for n_tok in tokens:
        n = -(-n_tok // 16)
        remote = list(range(1, n + 1))
        local = list(range(1, n + 1))
        spare = list(range(n_max + 1, n_max + 1 + staging_pages(n, full, shard)))
        direct = ReadSpec([names[1]], [shard], remote, local, [])
        staged = ReadSpec([names[0]], [full], remote, local, spare)
        t_direct = statistics.median(ray.get(decode.read.remote(direct, args.iters)))
        t_staged = statistics.median(ray.get(decode.read.remote(staged, args.iters)))
        lo, hi = rank * per, (rank + 1) * per
        got = ray.get(decode.heads.remote(local, 0, per))
        if not torch.equal(got, ray.get(p_full.heads.remote(remote, lo, hi))):
            raise SystemExit(f"{n_tok} tokens: the staged read put other bytes in place")
        moved = n * full.page_bytes
        print(
            f"{n_tok:>6} {n * shard.page_bytes / 2**20:>8.1f} {1e3 * t_direct:>9.2f} "
            f"{1e3 * t_staged:>9.2f} {t_staged / t_direct:>5.2f} {moved / t_staged / 1e9:>17.2f}"
        )
        rows.append(
            dict(
                tokens=n_tok,
                kept_mib=round(n * shard.page_bytes / 2**20, 1),
                direct_ms=round(1e3 * t_direct, 2),
                staged_ms=round(1e3 * t_staged, 2),
                x_direct=round(t_staged / t_direct, 1),
                staged_gbps_moved=round(moved / t_staged / 1e9, 1),
            )
        )
    ray.shutdown()
    what = (
        f"{args.layout} KV ({shard.dtype}), decode rank {rank} of TP {args.tp} reading from TP 1 "
        f"(staged) against TP {args.tp} (direct), median of {args.iters}"
    )
    write_result(args.out, "kv-staged", rows, model=what)


if __name__ == "__main__":
    main()
