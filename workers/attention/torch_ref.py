"""Pure-torch paged attention: the correctness oracle, and the CPU backend.

Per step, `plan` maps every key position t < max(kv_lens) of every sequence to its (page, slot),
so each layer gathers its K and V with one index each into `[batch, max_kv, heads, dim]`, and runs
one batched SDPA. Grouped-query heads are folded into the query length (`[batch, kv_heads,
q_len * group, dim]`), so K and V are never repeated per query head. The mask is causal within
the new tokens and ends at `kv_lens`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.attention.base import AttentionBackend, AttentionBatch


class TorchAttention(AttentionBackend):
    def plan(self, batch: AttentionBatch) -> None:
        device = batch.page_table.device
        page_size = self.pool.page_size
        num_seqs = len(batch.q_lens)
        max_q, max_kv = max(batch.q_lens), max(batch.kv_lens)
        q_lens = torch.tensor(batch.q_lens, device=device)
        kv_lens = torch.tensor(batch.kv_lens, device=device)
        key_pos = torch.arange(max_kv, device=device)
        self._key_page = batch.page_table.long()[:, key_pos // page_size]  # [B, max_kv]
        self._key_slot = (key_pos % page_size).expand(num_seqs, max_kv)
        self._padded_rows: torch.Tensor | None = None
        if max_q > 1:  # packed query rows -> (seq, i) at flat index seq * max_q + i
            seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
            starts = torch.cumsum(q_lens, 0) - q_lens
            row_in_seq = torch.arange(batch.num_tokens, device=device) - starts[seq_of_row]
            self._padded_rows = seq_of_row * max_q + row_in_seq
        # Query i of a sequence sits at position kv_len - q_len + i and sees keys up to it.
        q_pos = (kv_lens - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
            key_pos[None, None, :] < kv_lens[:, None, None]
        )  # [B, max_q, max_kv]
        group = self.num_q_heads // self.pool.layout.num_kv_heads
        self._mask = mask.repeat_interleave(group, dim=1)[:, None]  # rows ordered (i, head)
        self._shape = (num_seqs, max_q, group)
        self._batch = batch

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.store_kv(layer_id, k, v, self._batch)
        layer = self.pool.layer(layer_id)
        keys = layer[:, 0][self._key_page, self._key_slot].transpose(1, 2)  # [B, Hkv, T, D]
        values = layer[:, 1][self._key_page, self._key_slot].transpose(1, 2)
        num_seqs, max_q, group = self._shape
        num_kv_heads, head_dim = keys.shape[1], keys.shape[3]
        if self._padded_rows is not None:
            padded = q.new_zeros(num_seqs * max_q, q.shape[1], head_dim)
            padded[self._padded_rows] = q
            q = padded
        # [B * max_q, Hq, D] -> [B, Hkv, max_q * group, D]: query head h uses KV head h // group.
        q = q.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
        q = q.reshape(num_seqs, num_kv_heads, max_q * group, head_dim)
        out = F.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), attn_mask=self._mask, scale=self.scale
        )
        out = out.view(num_seqs, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
        out = out.reshape(num_seqs * max_q, num_kv_heads * group, head_dim)
        return out if self._padded_rows is None else out[self._padded_rows]
