"""Pure-torch paged attention: the correctness oracle, and the CPU backend.

It gathers each sequence's pages into a padded `[batch, max_pages * page_size]` key range and
runs one batched SDPA with a mask that is causal within the new tokens and ends at `kv_lens`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.attention.base import AttentionBackend, AttentionBatch


class TorchAttention(AttentionBackend):
    def plan(self, batch: AttentionBatch) -> None:
        device = batch.page_table.device
        num_seqs = len(batch.q_lens)
        max_q = max(batch.q_lens)
        max_kv = batch.page_table.shape[1] * self.pool.page_size
        q_lens = torch.tensor(batch.q_lens, device=device)
        kv_lens = torch.tensor(batch.kv_lens, device=device)
        # Row r of the packed queries goes to (seq, i): flat index seq * max_q + i.
        seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
        starts = torch.cumsum(q_lens, 0) - q_lens
        row_in_seq = torch.arange(batch.num_tokens, device=device) - starts[seq_of_row]
        self._padded_rows = seq_of_row * max_q + row_in_seq
        self._shape = (num_seqs, max_q)
        # Query i of a sequence sits at position kv_len - q_len + i and sees keys up to it.
        q_pos = (kv_lens - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]
        key_pos = torch.arange(max_kv, device=device)
        self._mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
            key_pos[None, None, :] < kv_lens[:, None, None]
        )
        self._mask = self._mask[:, None]  # [batch, 1 (heads), max_q, max_kv]
        self._batch = batch

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        batch = self._batch
        self.store_kv(layer_id, k, v, batch)
        kv = self.pool.layer(layer_id)[batch.page_table.long()]  # [B, P, 2, S, Hkv, D]
        num_seqs, max_pages, _, page_size, num_kv_heads, head_dim = kv.shape
        keys = kv[:, :, 0].reshape(num_seqs, max_pages * page_size, num_kv_heads, head_dim)
        values = kv[:, :, 1].reshape(num_seqs, max_pages * page_size, num_kv_heads, head_dim)
        max_q = self._shape[1]
        q_pad = q.new_zeros(num_seqs * max_q, q.shape[1], head_dim)
        q_pad[self._padded_rows] = q
        q_pad = q_pad.view(num_seqs, max_q, -1, head_dim)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=self._mask,
            scale=self.scale,
            enable_gqa=True,
        )  # [B, Hq, max_q, D]
        out = out.transpose(1, 2).reshape(num_seqs * max_q, -1, head_dim)
        return out[self._padded_rows]
