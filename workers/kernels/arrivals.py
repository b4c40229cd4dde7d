"""Zeroed int32 counters on a device, for kernels whose programs count their arrival and whose
last one to arrive finishes the work and resets the counter (`moe_route.route_fused`,
`moe_align`'s count). Allocated once per (user, device), on the first call (a warm-up forward,
before any CUDA-graph capture), so captured graphs keep valid pointers; the kernels reset them
for the next launch. Launches sharing one must run in order on one stream, as a model's forward
does."""

from __future__ import annotations

import torch

_counters: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(user: str, size: int, device: torch.device) -> torch.Tensor:
    """`user`'s `size` zeroed counters on `device`."""
    key = (user, device)
    if key not in _counters:
        _counters[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return _counters[key]
