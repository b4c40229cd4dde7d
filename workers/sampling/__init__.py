"""Tokens from logits: logit adjustments (bias, penalties, min_tokens), then batched sampling."""
