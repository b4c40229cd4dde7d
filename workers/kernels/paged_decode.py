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
    group_rows,
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
def _load(ptr, mask, MASKED: tl.constexpr):
    """`ptr`'s values, zeros where `mask` is off; unless `MASKED`, every one (no predicates)."""
    if MASKED:
        return tl.load(ptr, mask=mask, other=0)
    return tl.load(ptr)


@triton.jit
def _int8_tile(kv_ptr, kvf_ptr, idx_ptr, p0, t0, end, h, S_PAGE: tl.constexpr,
               S_KV: tl.constexpr, S_SLOT: tl.constexpr, S_HEAD: tl.constexpr,
               PS: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr,
               MASKED: tl.constexpr):  # fmt: skip
    """K and V of past tokens `[t0, t0 + TILE)` as int8 `[TILE, D]`, their rows' scales, and
    which tokens are before `end` (every one unless `MASKED`: the loads then carry no per-row
    predicates).

    The tile is `NP` runs of `SLOTS` consecutive slots of one page (`t0` is a multiple of the
    tile and, when a page is shorter, of the page): one page-table load and one 64-bit offset
    a run, per row only its slot's constant stride. Offsets a row, each with its own
    page-table load, redone in every layout the row's data took, were half the kernel's
    instructions (docs/notes/fp8-kv.md). Every stride is a multiple of a row's D + 4 bytes
    (so is where a layer's view starts): rows start 4-byte aligned, and said so the loads are
    4-byte copies (unsaid: a byte at a time)."""
    SLOTS: tl.constexpr = TILE if PS % TILE == 0 else (PS if TILE % PS == 0 else 1)
    NP: tl.constexpr = TILE // SLOTS
    first = t0 + tl.arange(0, NP) * SLOTS  # each run's first token
    slot = tl.arange(0, SLOTS)
    mask = tl.reshape((first[:, None] + slot[None, :]) < end, (TILE,))
    page = _load(idx_ptr + p0 + first // PS, first < end, MASKED)
    base = page.to(tl.int64) * S_PAGE + h * S_HEAD + (first % PS) * S_SLOT
    off = tl.reshape(base[:, None] + (slot * S_SLOT)[None, :], (TILE,))  # bytes
    k_row = tl.multiple_of(kv_ptr + off, 4)
    v_row = tl.multiple_of(k_row + S_KV, 4)
    dd = tl.arange(0, D)[None, :]
    # The scales after each row's bytes, through the pool's float32 view.
    k_scale_at = kvf_ptr + (off + D) // 4
    v_scale_at = k_scale_at + S_KV // 4
    k = _load(k_row[:, None] + dd, mask[:, None], MASKED)
    v = _load(v_row[:, None] + dd, mask[:, None], MASKED)
    return k, v, _load(k_scale_at, mask, MASKED), _load(v_scale_at, mask, MASKED), mask


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
def _attend_int8(q, k, v, k_scale, v_scale, mask, top, denom, acc, scale_log2,
                 BYTE_TRICK: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Online softmax (base 2) of one tile of int8 rows: the new running max, sum and output."""
    s = tl.dot(q, tl.trans(_to_f16(k, BYTE_TRICK))) * (k_scale * scale_log2)[None, :]
    if MASKED:
        s = tl.where(mask[None, :], s, float("-inf"))
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
def _int8_step(q, kv_ptr, kvf_ptr, idx_ptr, p0, t0, end, h, top, denom, acc, scale_log2,
               S_PAGE: tl.constexpr, S_KV: tl.constexpr, S_SLOT: tl.constexpr,
               S_HEAD: tl.constexpr, PS: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr,
               BYTE_TRICK: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One tile of int8 rows from `t0` into the online softmax."""
    k, v, k_scale, v_scale, mask = _int8_tile(
        kv_ptr, kvf_ptr, idx_ptr, p0, t0, end, h, S_PAGE, S_KV, S_SLOT, S_HEAD, PS, TILE, D,
        MASKED,
    )  # fmt: skip
    return _attend_int8(q, k, v, k_scale, v_scale, mask, top, denom, acc, scale_log2,
                        BYTE_TRICK, MASKED)  # fmt: skip


@triton.jit
def _paged_decode_kernel(
    q_ptr, q_st, q_sh, kv_ptr, kvf_ptr, indptr_ptr, idx_ptr, last_ptr, part_o_ptr,
    part_lse_ptr, lock_ptr, out_ptr, scale_log2, o_scale, S_PAGE: tl.constexpr,
    S_KV: tl.constexpr, S_SLOT: tl.constexpr, S_HEAD: tl.constexpr, GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr, HALF: tl.constexpr, PS: tl.constexpr, TILE: tl.constexpr,
    SPLITS: tl.constexpr, STAGES: tl.constexpr, ALL_MERGE: tl.constexpr,
    INT8_ROWS: tl.constexpr, BYTE_TRICK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """`kvf_ptr`: the pool's float32 view (int8 rows' scales; unused for FP8 pages). The pool's
    strides are constants (a model's, so one build each): they fold into the offsets' products
    and the loads' immediates."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    p0, start, end = _split_tokens(indptr_ptr, last_ptr, b, split, PS, TILE, SPLITS)
    wait_for_inputs(PDL)  # q, and the new token's K/V in the pool
    if INT8_ROWS:
        q = group_rows(q_ptr, q_st, q_sh, b, h, GROUP, 2 * HALF).to(tl.float16)
    else:
        q1, q2 = group_queries(q_ptr, q_st, q_sh, b, h, GROUP, HALF)
        q1, q2 = q1.to(tl.float16), q2.to(tl.float16)
    top, denom, acc = _empty_softmax(HALF)
    if INT8_ROWS:
        full_end = start + (end - start) // TILE * TILE  # whole tiles: no per-row masks
        for t0 in tl.range(start, full_end, TILE, num_stages=STAGES):
            top, denom, acc = _int8_step(
                q, kv_ptr, kvf_ptr, idx_ptr, p0, t0, end, h, top, denom, acc, scale_log2,
                S_PAGE, S_KV, S_SLOT, S_HEAD, PS, TILE, 2 * HALF, BYTE_TRICK, False,
            )  # fmt: skip
        if full_end < end:
            top, denom, acc = _int8_step(
                q, kv_ptr, kvf_ptr, idx_ptr, p0, full_end, end, h, top, denom, acc, scale_log2,
                S_PAGE, S_KV, S_SLOT, S_HEAD, PS, TILE, 2 * HALF, BYTE_TRICK, True,
            )  # fmt: skip
    else:
        for t0 in tl.range(start, end, TILE, num_stages=STAGES):
            t = t0 + tl.arange(0, TILE)
            k1, k2, v, mask = tile_kv(kv_ptr, idx_ptr, p0, t, end, h, S_PAGE, S_KV, S_SLOT,
                                      S_HEAD, PS, HALF)  # fmt: skip
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
            q, q.stride(0), q.stride(1), *pools, *page_table, parts.part_o, parts.part_lse,
            parts.locks, out, *scales,
        )  # fmt: skip
        options = dict(
            S_PAGE=kv.stride(0), S_KV=kv.stride(1), S_SLOT=kv.stride(2), S_HEAD=kv.stride(3),
            GROUP=self.group, GROUP_P2=parts.group_p2, HALF=d // 2, PS=kv.shape[2],
            SPLITS=parts.splits, INT8_ROWS=self.int8_rows, BYTE_TRICK=self.int8_rows and q.is_cuda,
            **self.launch, **pdl.launch_options(q),
        )  # fmt: skip
        parts.launch(_paged_decode_kernel, grid, args, options, q)
        return out
