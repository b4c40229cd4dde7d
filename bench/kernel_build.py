"""A Triton kernel's build for a GPU, inspected without one: registers and spills (`ptxas -v`),
the instructions of its longest loop by source line and by opcode (`nvdisasm` of the cubin), and
the shared-memory layout each asynchronous copy lands in (the TTGIR).

    python -m bench.kernel_build int8_decode --tile 64 --warps 4 --stages 3 [--arch 90]
    python -m bench.kernel_build moe_gate_up --block-n 4 --block-k 512 --warps 4 --stages 1
    python -m bench.kernel_build lora_expand --block-n 256 --warps 4

What it answers, before a GPU is at hand: how many instructions a tile costs against the time
its bytes take (an SM issues at most 4 warp instructions a cycle), whether a change moved work
out of the loop, and whether a copy lands transposed without swizzling (`vec = 1`, the
fastest dimension not the global one's), where every lane of a warp writes one bank: a 32-way
conflict no instruction count shows (docs/notes/fp8-kv.md). The build is that of the Triton
installed here, which may not be the GPU image's: compare builds of one version.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
_COPY = re.compile(
    r"%(\w+?)(?:_\d+)? = ttg\.async_copy_global_to_local .*-> <(\d+(?:x\d+)*)x\w+, #(\w+)"
)


@dataclasses.dataclass(frozen=True)
class Build:
    registers: int
    spill_bytes: int
    loop_instructions: int  # a thread's, in the longest loop: a tile's, for a tile loop
    by_line: list[tuple[str, int]]  # the loop's instructions by source line, most first
    by_opcode: list[tuple[str, int]]
    copies: list[tuple[str, str, str]]  # (value, shape, shared layout) of the async copies

    def conflicted_copies(self) -> list[tuple[str, str, str]]:
        """Copies of 2-D tiles into unswizzled layouts with the first dimension fastest: each
        lane's element a row apart in shared memory, so a warp's writes share banks."""
        return [c for c in self.copies if "x" in c[1] and re.search(r"vec = 1,.*order = \[0", c[2])]


def _ptxas(arch: int) -> str:
    """The ptxas Triton itself would run for `arch` (versions differ in which they bundle)."""
    from triton.backends.nvidia import compiler

    try:
        return compiler.get_ptxas(arch).path  # type: ignore[call-arg]
    except TypeError:  # Triton before 3.7 bundles one
        return compiler.get_ptxas().path  # type: ignore[call-arg]


def _nvdisasm() -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm")


def build(
    fn: Any, types: dict[str, str], constexprs: dict[str, Any], num_warps: int,
    num_stages: int | None = None, arch: int = 90, divisible: tuple[str, ...] = (),
) -> Build:  # fmt: skip
    """Compile `fn` (a `triton.jit` function) for `cuda:<arch>`: `types` the non-constexpr
    arguments' Triton types ("*bf16", "i32", ...; unnamed ones i32), pointers and the names in
    `divisible` marked 16-divisible as the launcher marks aligned arguments."""
    signature, values, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            values[(i,)] = constexprs[name]
            continue
        signature[name] = types.get(name, "i32")
        if signature[name].startswith("*") or name in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options: dict[str, Any] = dict(num_warps=num_warps)
    if num_stages is not None:
        options["num_stages"] = num_stages
    source = ASTSource(fn=fn, signature=signature, constexprs=values, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        ptx.write_text(kernel.asm["ptx"])
        arch_flag = f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}"
        report = subprocess.run([_ptxas(arch), arch_flag, "-v", str(ptx), "-o", str(cubin)],
                                capture_output=True, text=True, check=True).stderr  # fmt: skip
        sass = subprocess.run([_nvdisasm(), "-c", "-g", str(cubin)], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    registers = int(re.search(r"Used (\d+) registers", report).group(1))  # type: ignore[union-attr]
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))
    count, lines, opcodes = _longest_loop(sass.splitlines())
    ttgir = kernel.asm["ttgir"]
    copies = sorted({(m[1], m[2], _layout(ttgir, m[3])) for m in _COPY.finditer(ttgir)})
    return Build(registers, spills, count, lines.most_common(), opcodes.most_common(), copies)


def _layout(ttgir: str, name: str) -> str:
    found = re.search(rf"^#{name} = (.*)$", ttgir, re.M)
    return found.group(1) if found else name


def _longest_loop(sass: list[str]) -> tuple[int, collections.Counter, collections.Counter]:
    """The instructions between a label and the furthest backward branch to it (the longest
    loop body), counted by the source line `nvdisasm -g` names and by opcode."""
    labels = {m[1]: i for i, line in enumerate(sass) if (m := _LABEL.match(line))}
    body: tuple[int, int] = (0, -1)
    for i, line in enumerate(sass):
        m = _BRANCH.search(line)
        if m and labels.get(m[1], i) < i and i - labels[m[1]] > body[1] - body[0]:
            body = (labels[m[1]], i)
    lines: collections.Counter = collections.Counter()
    opcodes: collections.Counter = collections.Counter()
    source = "?"
    for line in sass[body[0] : body[1] + 1]:
        if "## File" in line:
            path, number = line.split('"')[1], line.rsplit(" ", 1)[-1]
            source = f"{Path(path).name}:{number}"
        elif m := _INSTRUCTION.match(line):
            lines[source] += 1
            opcodes[m[1].split(".")[0]] += 1
    return sum(lines.values()), lines, opcodes


def _paged_decode(args: argparse.Namespace, int8: bool) -> Build:
    """The 8-bit paged decode kernel at the heads `bench_fp8_decode --attention` times
    (Llama-3-8B's: 32 / 8, head_dim 128, page 16)."""
    from bench.bench_fp8_decode import HEAD_DIM, KV_HEADS, PAGE, Q_HEADS, row_bytes
    from workers.kernels import paged_decode

    row = row_bytes(int8)
    strides = dict(S_HEAD=row, S_SLOT=KV_HEADS * row, S_KV=PAGE * KV_HEADS * row,
                   S_PAGE=2 * PAGE * KV_HEADS * row)  # a pool of one layer  # fmt: skip
    group = Q_HEADS // KV_HEADS
    consts = dict(GROUP=group, GROUP_P2=group, HALF=HEAD_DIM // 2, PS=PAGE, TILE=args.tile,
                  SPLITS=2, STAGES=args.stages, ALL_MERGE=False, INT8_ROWS=int8,
                  BYTE_TRICK=int8, PDL=True, **strides)  # fmt: skip
    types = dict(q_ptr="*bf16", kv_ptr="*i8" if int8 else "*fp8e4nv", kvf_ptr="*fp32",
                 indptr_ptr="*i32", idx_ptr="*i32", last_ptr="*i32", part_o_ptr="*fp32",
                 part_lse_ptr="*fp32", lock_ptr="*i32", out_ptr="*bf16", scale_log2="fp32",
                 o_scale="fp32")  # fmt: skip
    return build(paged_decode._paged_decode_kernel, types, consts, args.warps, args.stages,
                 args.arch)  # fmt: skip


def _moe(args: argparse.Namespace, kernel: str) -> Build:
    """A kernel of the MoE experts (GEMV or tiles) at Qwen3-30B-A3B's shapes (top-8)."""
    from workers.kernels import moe_fused, moe_gemv

    fn = getattr(moe_gemv if "gemv" in kernel else moe_fused, kernel)
    consts: dict[str, Any] = dict(BLOCK_N=args.block_n, BLOCK_K=args.block_k, PDL=True)
    if "gemv" in kernel:
        consts["LOOP_STAGES"] = args.stages
    else:
        consts["BLOCK_M"] = args.block_m
    if kernel == "_w2_gemv_slots_kernel":
        consts["TOPK_P2"] = 8
    types = dict(x_ptr="*bf16", w_ptr="*bf16", act_ptr="*bf16", out_ptr="*bf16",
                 ids_ptr="*i32", weights_ptr="*fp32", pairs_ptr="*i32",
                 tile_expert_ptr="*i32")  # fmt: skip
    strides = ("H", "INTER", "stride_x", "stride_we", "stride_wn", "stride_act", "stride_out")
    return build(fn, types, consts, args.warps, args.stages, args.arch, strides)


def _lora(args: argparse.Namespace, kernel: str) -> Build:
    """A LoRA kernel over 8 adapter slots of rank 16 and q/k/v's 3 parts, 16 tokens."""
    from workers.kernels import lora_sgmv

    fn = getattr(lora_sgmv, kernel)
    common = dict(SLOTS=8, T_PAD=16, PDL=True)
    if kernel == "_shrink_slot_kernel":
        consts = dict(PR=48, PR_PAD=64, SPLIT=args.block_k, BLOCK_K=args.tile, **common)
    else:
        consts = dict(R=16, R_PAD=16, PARTS=3, NORM_IN=False, BLOCK_N=args.block_n, **common)
    types = dict(x_ptr="*bf16", a_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16", mask_ptr="*bf16",
                 part_ptr="*fp32", ss_ptr="*fp64", eps="fp32")  # fmt: skip
    strides = ("n_in", "n_out", "stride_x", "stride_y")
    return build(fn, types, consts, args.warps, args.stages, args.arch, strides)


KERNELS: dict[str, Callable[[argparse.Namespace], Build]] = {
    "int8_decode": lambda a: _paged_decode(a, int8=True),
    "fp8_decode": lambda a: _paged_decode(a, int8=False),
    "moe_gate_up": lambda a: _moe(a, "_w13_gemv_kernel"),
    "moe_down": lambda a: _moe(a, "_w2_gemv_kernel"),
    "moe_down_slots": lambda a: _moe(a, "_w2_gemv_slots_kernel"),
    "moe_gate_up_tiles": lambda a: _moe(a, "_w13_kernel"),
    "moe_down_tiles": lambda a: _moe(a, "_w2_kernel"),
    "lora_shrink": lambda a: _lora(a, "_shrink_slot_kernel"),
    "lora_expand": lambda a: _lora(a, "_expand_slot_kernel"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=sorted(KERNELS))
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--tile", type=int, default=64,
                        help="decode kernels: tokens a tile; LoRA shrink: K a step")  # fmt: skip
    parser.add_argument("--block-n", type=int, default=4,
                        help="MoE kernels: rows a program; LoRA expand: columns")  # fmt: skip
    parser.add_argument("--block-m", type=int, default=128, help="MoE tile kernels: rows")
    parser.add_argument("--block-k", type=int, default=512,
                        help="MoE kernels: K a step; LoRA shrink: K a program")  # fmt: skip
    parser.add_argument("--top", type=int, default=12, help="source lines and opcodes shown")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    result = KERNELS[args.kernel](args)
    print(f"registers {result.registers}, spills {result.spill_bytes} B, "
          f"loop {result.loop_instructions} instructions a thread")  # fmt: skip
    print("by line:", ", ".join(f"{k} {v}" for k, v in result.by_line[: args.top]))
    print("by opcode:", ", ".join(f"{k} {v}" for k, v in result.by_opcode[: args.top]))
    for value, shape, layout in result.copies:
        print(f"async copy {value} [{shape}] -> {layout}")
    if conflicted := result.conflicted_copies():
        print("WARNING: copies into transposed unswizzled layouts:", [c[0] for c in conflicted])


if __name__ == "__main__":
    main()
