"""Print the GPU suite's results as one table: `python -m bench.gpu_table OUT_DIR`."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def main(out: Path) -> None:
    tests = out / "tests.xml"
    if tests.is_file():
        suite = ET.parse(tests).getroot().find("testsuite")
        if suite is not None:
            a = suite.attrib
            print(
                f"GPU tests: {a['tests']} run, {a['failures']} failed, {a['errors']} errors, "
                f"{a['skipped']} skipped, {float(a['time']):.0f} s"
            )
    decodes = (
        ("decode", "default kernels"),
        ("decode_tc", "tensor-core decode forced"),
        ("decode_tp", "2 GPUs, tensor parallel"),
    )
    for name, label in decodes:
        decode = _load(out / f"{name}.json")
        if not decode:
            continue
        print(f"\ndecode, {label} (copy bandwidth {decode['copy_bandwidth_gbps']:.0f} GB/s)")
        print(
            "batch  context  engine ms  overlap ms  sync ms  graph ms  eager ms  floor ms  "
            "x floor  tok/s"
        )
        for r in decode["rows"]:
            engine, graph = (
                "-" if r[k] is None else f"{r[k]:.2f}" for k in ("engine_ms", "graph_replay_ms")
            )
            print(
                f"{r['batch']:5d}  {r['context']:7d}  {engine:>9}  {r['overlap_ms']:10.2f}  "
                f"{r['sync_ms']:7.2f}  {graph:>8}  {r['eager_step_ms']:8.2f}  "
                f"{r['floor_ms']:8.2f}  {r['x_floor']:7.2f}  {r['tokens_per_s']:8d}"
            )
    prefill = _load(out / "prefill.json")
    if prefill:
        print(f"\nprefill (bf16 GEMM peak {prefill['gemm_peak_tflops']:.0f} TFLOP/s)")
        print("prompts x tokens  step ms  TFLOP/s  of peak  tokens/s")
        for r in prefill["rows"]:
            shape = f"{r['prompts']} x {r['tokens']}"
            if "floor_ms" in r:  # a short prompt: against reading the weights once
                print(
                    f"{shape:>16}  {r['step_ms']:7.1f}  ({r['x_floor']:.2f}x the weight read; "
                    f"eager {r['eager_ms']:.1f} ms)"
                )
                continue
            print(
                f"{shape:>16}  {r['step_ms']:7.1f}  {r['tflops']:7.1f}  "
                f"{r['of_gemm_peak']:7.1%}  {r['tokens_per_s']:8d}"
            )
    offline = _load(out / "offline.json")
    if offline:
        print("\noffline (nano-vllm workload, Qwen3-0.6B shapes)")
        for name in ("engine", "engine_subset", "hf_subset"):
            r = offline[name]
            print(
                f"{name:14} {r['requests']:4d} requests  {r['output_tokens']:7d} tokens  "
                f"{r['seconds']:7.2f} s  {r['tokens_per_s']:7d} tokens/s"
            )
        print(f"engine / HF on the same requests: {offline['ratio']:.1f}x")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
