"""Disaggregated prefill/decode: the two hand-off roles and the leases between them.

`prefill.PrefillEngine` computes a prompt and pins its KV pages under a lease (`leases`);
`decode.DecodeEngine` reads those pages over NIXL and decodes; `handoff.HandoffEngine` is their
common base; `group_transfer` moves every tensor-parallel rank's share of the pages.
"""
