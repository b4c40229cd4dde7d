"""The split-KV decode kernel over 8-bit paged pools, in one Triton launch: FP8 pages with one
scale a layer (`fp8_decode.py`, whose notes say why not FlashInfer's) and int8 rows each with
its own scale (`int8_decode.py`, which says how the scales enter the products).

Programs are (sequence, KV head, split of the sequence's tokens); the KV head's GQA group of
query heads are the rows of a tensor-core product; each tile is cast to fp16 in registers, its
loads software-pipelined over `STAGES` tiles; online softmax in base 2; the splits merged in the
same launch (`split_kv_common`). The new tokens' K/V are written before (the quantizing rotary
stores of `rope.py`) and read back from the pool like the others: the kernel waits for its
inputs (PDL) before its first K/V load, so rows that are tokens of one sequence (a prefill
chunk on a decode graph) see each other's K/V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.pdl import wait_for_inputs
from workers.kernels.split_kv_common import (
    SplitParts,
    attend,
    finish_split,
    group_queries,
    num_splits,
    sequence_pages,
    tile_kv,
)
from workers.kernels.tuning import FP8DecodeLaunch, fp8_decode_launch, int8_decode_launch


@triton.jit
def _split_tokens(indptr_ptr, last_ptr, b, split, PS: tl.constexpr, TILE: tl.constexpr,
                 SPLITS: tl.constexpr):  # fmt: skip
    """Sequence `b`'s first CSR page entry, and split `split`'s tokens `[start, end)` of all
    its tokens (the new ones included): whole tiles a split, but for the last."""
    p0, kv_len = sequence_pages(indptr_ptr, last_ptr, b, PS)
    chunk = tl.cdiv(tl.cdiv(kv_len, SPLITS), TILE) * TILE
    start = split * chunk
    return p0, start, tl.minimum(start + chunk, kv_len)


@triton.jit
def _empty_softmax(HALF: tl.constexpr):
    """An online softmax's state before its first tile: running max, sum and output."""
    top = tl.full([16], -1.0e30, dtype=tl.float32)
    return top, tl.zeros([16], dtype=tl.float32), tl.zeros([16, 2 * HALF], dtype=tl.float32)


@triton.jit
def _int8_tile(kv_ptr, kvf_ptr, idx_ptr, p0, t, end, h, s_page, s_kv, s_slot, s_head,
          PS: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """K (two rotary halves) and V of past tokens `t` as int8, and their rows' scales."""
    mask = t < end
    page = tl.load(idx_ptr + p0 + t // PS, mask=mask, other=0).to(tl.int64)
    off = page * s_page + (t % PS).to(tl.int64) * s_slot + h * s_head  # bytes
    # Every stride is a multiple of a row's D + 4 bytes (so is where a layer's view starts):
    # rows start 4-byte aligned. Unsaid, a head stride not a multiple of 16 (132 at D = 128)
    # leaves the compiler loading a byte at a time.
    row = tl.multiple_of(kv_ptr + off, 4)
    v_row = tl.multiple_of(row + s_kv, 4)
    dh = tl.arange(0, HALF)[None, :]
    dd = tl.arange(0, 2 * HALF)[None, :]
    k1 = tl.load(row[:, None] + dh, mask=mask[:, None], other=0)
    k2 = tl.load(row[:, None] + HALF + dh, mask=mask[:, None], other=0)
    v = tl.load(v_row[:, None] + dd, mask=mask[:, None], other=0)
    # The scale after each row's bytes, through the pool's float32 view (rows are D + 4 bytes,
    # every stride a multiple of 4).
    k_scale = tl.load(kvf_ptr + (off + 2 * HALF) // 4, mask=mask, other=0.0)
    v_scale = tl.load(kvf_ptr + (off + s_kv + 2 * HALF) // 4, mask=mask, other=0.0)
    return k1, k2, v, k_scale, v_scale, mask


@triton.jit
def _to_f16(x, BYTE_TRICK: tl.constexpr):
    """int8 to fp16, exact. `BYTE_TRICK` (CUDA): four bytes a register, each flipped to x + 128
    and placed under fp16's exponent of 1024 (bits 0x64xx: 1024 + x + 128) by byte permutes,
    then 1152 taken off two halves at a time: ~1.25 instructions a value where a conversion
    instruction per value (I2F, a quarter of the integer rate) would bound the kernel near
    the pool's read time."""
    if BYTE_TRICK:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, c;
            xor.b32 t, $2, 0x80808080;
            mov.b32 c, 0x64806480;
            prmt.b32 $0, t, 0x64646464, 0x4140;
            prmt.b32 $1, t, 0x64646464, 0x4342;
            sub.f16x2 $0, $0, c;
            sub.f16x2 $1, $1, c;
            }""",
            constraints="=r,=r,r",
            args=[x],
            dtype=tl.float16,
            is_pure=True,
            pack=4,
        )
    return x.to(tl.float16)


@triton.jit
def _v_to_f16(v, BYTE_TRICK: tl.constexpr):
    """An int8 V tile [TILE, D] as fp16, widened in the layout it is loaded in (runs of D's
    bytes a thread) and only then laid out as the P.V product's operand (through shared memory
    as fp16, transposed 16 bits at a time). Widened in the operand's own layout, as the compiler
    otherwise chooses, each thread gathers its bytes down the token axis: a shared-memory load
    a byte, 128 a thread a 128-token tile at 4 warps (docs/notes/fp8-kv.md). The reshape into
    groups of 4 along D keeps the compiler from moving the widening past the layout change."""
    tile: tl.constexpr = v.shape[0]
    dim: tl.constexpr = v.shape[1]
    v16 = _to_f16(tl.reshape(v, (tile, dim // 4, 4)), BYTE_TRICK)
    return tl.reshape(v16, (tile, dim))


@triton.jit
def _attend_int8(q1, q2, k1, k2, v, k_scale, v_scale, mask, top, denom, acc, scale_log2,
                 BYTE_TRICK: tl.constexpr):  # fmt: skip
    """Online softmax (base 2) of one tile of int8 rows: the new running max, sum and output."""
    k1, k2 = _to_f16(k1, BYTE_TRICK), _to_f16(k2, BYTE_TRICK)
    s = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))
    s = tl.where(mask[None, :], s * (k_scale * scale_log2)[None, :], float("-inf"))
    top_new = tl.maximum(top, tl.max(s, axis=1))
    alpha = tl.exp2(top - top_new)
    p = tl.exp2(s - top_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    v_max = tl.max(v_scale, axis=0)
    v_max = tl.where(v_max > 0.0, v_max, 1.0)
    pv = (p * (v_scale / v_max)[None, :]).to(tl.float16)
    acc = acc * alpha[:, None] + tl.dot(pv, _v_to_f16(v, BYTE_TRICK)) * v_max
    return top_new, denom, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr, q_st, q_sh, kv_ptr, kvf_ptr, s_page, s_kv, s_slot, s_head, indptr_ptr, idx_ptr,
    last_ptr, part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, scale_log2, o_scale,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HALF: tl.constexpr, PS: tl.constexpr,
    TILE: tl.constexpr, SPLITS: tl.constexpr, STAGES: tl.constexpr, ALL_MERGE: tl.constexpr,
    INT8_ROWS: tl.constexpr, BYTE_TRICK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """`kvf_ptr`: the pool's float32 view (int8 rows' scales; unused for FP8 pages)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    p0, start, end = _split_tokens(indptr_ptr, last_ptr, b, split, PS, TILE, SPLITS)
    wait_for_inputs(PDL)  # q, and the new token's K/V in the pool
    q1, q2 = group_queries(q_ptr, q_st, q_sh, b, h, GROUP, HALF)
    q1, q2 = q1.to(tl.float16), q2.to(tl.float16)
    top, denom, acc = _empty_softmax(HALF)
    for t0 in tl.range(start, end, TILE, num_stages=STAGES):
        t = t0 + tl.arange(0, TILE)
        if INT8_ROWS:
            k1, k2, v, k_scale, v_scale, mask = _int8_tile(
                kv_ptr, kvf_ptr, idx_ptr, p0, t, end, h, s_page, s_kv, s_slot, s_head, PS, HALF
            )
            top, denom, acc = _attend_int8(q1, q2, k1, k2, v, k_scale, v_scale, mask, top,
                                           denom, acc, scale_log2, BYTE_TRICK)  # fmt: skip
        else:
            k1, k2, v, mask = tile_kv(kv_ptr, idx_ptr, p0, t, end, h, s_page, s_kv, s_slot,
                                      s_head, PS, HALF)  # fmt: skip
            k1, k2, v = k1.to(tl.float16), k2.to(tl.float16), v.to(tl.float16)
            top, denom, acc = attend(q1, q2, k1, k2, v, mask, top, denom, acc, scale_log2)
    finish_split(acc, top, denom, o_scale, part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, b, h,
                 split, num_kv_heads, GROUP, GROUP_P2, HALF, SPLITS, ALL_MERGE, PDL)  # fmt: skip


class PagedDecode:
    """The kernel over a layer's whole 8-bit paged pool (every token attended to already
    stored): its fixed buffers for decode steps of exactly `batch_size` rows and its launch
    choices; `run` may be captured in a CUDA graph (nothing allocated but the output)."""

    int8_rows = False  # the pool's rows: FP8 values (one scale a layer) or int8 rows

    def __init__(
        self, batch_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        device: torch.device, launch: FP8DecodeLaunch | None = None, splits: int | None = None,
    ) -> None:  # fmt: skip
        """`launch`, `splits`: choices other than the GPU's FP8 table (a sweep's, a test's);
        the splits by default for about `launch.programs` programs (`num_splits`)."""
        self.batch_size = batch_size
        self.group = num_q_heads // num_kv_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        if launch is None:
            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
            table = int8_decode_launch if self.int8_rows else fp8_decode_launch
            launch = table(batch_size, gpu)
        self.launch = dict(TILE=launch.tile, STAGES=launch.stages, num_warps=launch.num_warps)
        splits = splits or num_splits(batch_size, num_kv_heads, launch.programs)
        self.parts = SplitParts(batch_size, num_kv_heads, self.group, head_dim, splits, device)

    def run(
        self, q: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor,
        page_table: tuple[torch.Tensor, ...], scales: tuple[float, float],
    ) -> torch.Tensor:  # fmt: skip
        """The kernel over q `[B, Hq, D]` and `kv` one layer's pool `[pages, 2, page_size, Hkv,
        row]` (`pools`: its bytes and, for int8 rows, its float32 view), the page table in
        FlashInfer's CSR form, `scales` the softmax's (base 2) and the output's."""
        b, hq, d = q.shape
        assert b == self.batch_size and d == self.head_dim  # the split buffers' sizes
        assert hq == self.num_kv_heads * self.group and kv.shape[-2] == self.num_kv_heads
        assert q.stride(-1) == kv.stride(-1) == 1
        out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
        parts = self.parts
        grid = (b, self.num_kv_heads, parts.splits)
        args = (
            q, q.stride(0), q.stride(1), *pools, kv.stride(0), kv.stride(1), kv.stride(2),
            kv.stride(3), *page_table, parts.part_o, parts.part_lse, parts.locks, out, *scales,
        )  # fmt: skip
        options = dict(
            GROUP=self.group, GROUP_P2=parts.group_p2, HALF=d // 2, PS=kv.shape[2],
            SPLITS=parts.splits, INT8_ROWS=self.int8_rows, BYTE_TRICK=self.int8_rows and q.is_cuda,
            **self.launch, **pdl.launch_options(q),
        )  # fmt: skip
        parts.launch(_paged_decode_kernel, grid, args, options, q)
        return out
