"""The CPU LM head: logits of a few rows against a vocabulary-sized float32 weight, as
`ParallelLMHead.logits` computes them on the CPU (W h^T, then a transposed copy) against
`F.linear` (h W^T), and against the time to read the weight once (the memory floor).

    python -m bench.cpu_lm_head [--vocab 49152 --hidden 576] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.gpu_common import wall_ms
from bench.results_io import add_out_argument, write_result

ROWS = (1, 3, 8, 16, 64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--repeat", type=int, default=20)
    add_out_argument(ap)
    args = ap.parse_args()
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden)
    copy = torch.empty_like(weight)
    floor_ms = wall_ms(lambda: copy.copy_(weight), iters=args.repeat) / 2  # reads and writes
    rows = []
    for m in ROWS:
        hidden = torch.randn(m, args.hidden)
        ours = wall_ms(lambda h=hidden: torch.mm(weight, h.t()).t().contiguous(),
                       iters=args.repeat)  # fmt: skip
        linear = wall_ms(lambda h=hidden: F.linear(h, weight), iters=args.repeat)
        rows.append({"rows": m, "ours_ms": ours, "f_linear_ms": linear,
                     "x_f_linear": linear / ours, "x_floor": ours / floor_ms})  # fmt: skip
        print(f"rows {m:3d}  W h^T {ours:7.2f} ms  F.linear {linear:7.2f} ms  "
              f"speed-up {linear / ours:4.2f}x  {ours / floor_ms:4.2f}x the weight read "
              f"({floor_ms:.2f} ms)", flush=True)  # fmt: skip
    write_result(
        args.out,
        "cpu-lm-head",
        rows,
        model=f"float32 weight [{args.vocab}, {args.hidden}] (SmolLM2's LM head)",
        title="CPU LM head: W h^T against F.linear",
        measured={"weight_read_ms": floor_ms},
        notes=f"torch on {torch.get_num_threads()} threads",
    )


if __name__ == "__main__":
    main()
