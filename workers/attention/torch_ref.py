"""Pure-torch paged attention: the correctness oracle, and the CPU backend.

`plan` splits a step's sequences into decode rows (one new token) and prefill chunks, so that a
mixed batch never pads sixty one-token queries to the length of one long chunk. For each group
it lists the pages that hold key positions t < max(kv_lens); each layer then gathers those
whole pages of K and of V (`index_select` of contiguous page rows: ~5x faster on a CPU than
indexing by (page, slot)), cut to `[batch, max_kv, heads, dim]`, and runs one SDPA.
An FP8 pool's keys and values are dequantized after the gather (`kv_dtype.dequantize`).
Grouped-query heads are folded into the query length (`[batch, kv_heads, q_len * group,
dim]`), so K and V are never repeated per query head. Masks are causal within the new tokens
and end at `kv_lens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.attention.base import AttentionBackend, AttentionBatch
from workers.kvcache.kv_dtype import as_bytes, dequantize


@dataclass
class _Group:
    """Attention plan for a subset of the step's sequences."""

    rows: torch.Tensor  # [n] packed query rows of the step that belong to this group
    pages: torch.Tensor  # [B * P] the pages holding each sequence's first P * page_size keys
    max_kv: int
    mask: torch.Tensor  # [B, 1, max_q * group, max_kv], rows ordered (query, head in group)
    padded_rows: torch.Tensor | None  # rows -> seq * max_q + i, when max_q > 1
    num_seqs: int
    max_q: int


class TorchAttention(AttentionBackend):
    def plan(self, batch: AttentionBatch) -> None:
        starts = [0]
        for q in batch.q_lens:
            starts.append(starts[-1] + q)
        decode = [i for i, q in enumerate(batch.q_lens) if q == 1]
        prefill = [i for i, q in enumerate(batch.q_lens) if q > 1]
        self._groups = [self._plan_group(batch, seqs, starts) for seqs in (decode, prefill) if seqs]
        self._batch = batch

    def _plan_group(self, batch: AttentionBatch, seqs: list[int], starts: list[int]) -> _Group:
        device = batch.page_table.device
        page_size = self.pool.page_size
        q_list = [batch.q_lens[i] for i in seqs]
        kv_list = [batch.kv_lens[i] for i in seqs]
        max_q, max_kv = max(q_list), max(kv_list)
        q_lens = torch.tensor(q_list, device=device)
        kv_lens = torch.tensor(kv_list, device=device)
        rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=device) for i in seqs])
        key_pos = torch.arange(max_kv, device=device)
        table = batch.page_table[torch.tensor(seqs, device=device)].long()
        padded_rows = None
        if max_q > 1:  # group rows -> (seq, i) at flat index seq * max_q + i
            seq_of_row = torch.repeat_interleave(torch.arange(len(seqs), device=device), q_lens)
            first = torch.cumsum(q_lens, 0) - q_lens
            padded_rows = (
                seq_of_row * max_q + torch.arange(len(rows), device=device) - first[seq_of_row]
            )
        # Query i of a sequence sits at position kv_len - q_len + i and sees keys up to it.
        q_pos = (kv_lens - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
            key_pos[None, None, :] < kv_lens[:, None, None]
        )  # [B, max_q, max_kv]
        group = self.num_q_heads // self.pool.layout.num_kv_heads
        return _Group(
            rows=rows,
            pages=table[:, : -(-max_kv // page_size)].reshape(-1),
            max_kv=max_kv,
            mask=mask.repeat_interleave(group, dim=1)[:, None],
            padded_rows=padded_rows,
            num_seqs=len(seqs),
            max_q=max_q,
        )

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.store_kv(layer_id, k, v, self._batch)
        if len(self._groups) == 1 and len(self._groups[0].rows) == q.shape[0]:
            return self._attend(layer_id, q, self._groups[0])
        out = torch.empty_like(q)
        for g in self._groups:
            out[g.rows] = self._attend(layer_id, q[g.rows], g)
        return out

    def _attend(self, layer_id: int, q: torch.Tensor, g: _Group) -> torch.Tensor:
        layer = self.pool.layer(layer_id)
        raw, stored, scales = as_bytes(layer), layer.dtype, self.pool.scales

        def gather(kv: int, scale: float) -> torch.Tensor:  # [B, Hkv, max_kv, D]
            part = raw[:, kv]  # [pages, page_size, Hkv, row]: each page one contiguous row
            rows = part.flatten(1).index_select(0, g.pages)
            rows = rows.view(g.num_seqs, -1, *part.shape[2:])[:, : g.max_kv]
            # Transposed after dequantizing: every dtype gives SDPA the same strides (its CPU
            # kernel, and so its rounding, depends on them).
            return dequantize(rows.view(stored), q.dtype, scale).transpose(1, 2)

        keys, values = gather(0, scales.k[layer_id]), gather(1, scales.v[layer_id])
        num_kv_heads, head_dim = keys.shape[1], keys.shape[3]
        group = q.shape[1] // num_kv_heads
        if g.padded_rows is not None:
            padded = q.new_zeros(g.num_seqs * g.max_q, q.shape[1], head_dim)
            padded[g.padded_rows] = q
            q = padded
        # [B * max_q, Hq, D] -> [B, Hkv, max_q * group, D]: query head h uses KV head h // group.
        q = q.view(g.num_seqs, g.max_q, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
        q = q.reshape(g.num_seqs, num_kv_heads, g.max_q * group, head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=g.mask, scale=self.scale)
        out = out.view(g.num_seqs, num_kv_heads, g.max_q, group, head_dim).permute(0, 2, 1, 3, 4)
        out = out.reshape(g.num_seqs * g.max_q, num_kv_heads * group, head_dim)
        return out if g.padded_rows is None else out[g.padded_rows]
