"""Speculative decoding: drafts (prompt lookup or a draft model), their verification in the
target's step, acceptance, and the rollback of rejected drafts' KV."""
