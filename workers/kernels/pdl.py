"""Programmatic dependent launch (PDL, Hopper and newer) for the Triton kernels of a forward.

A kernel launched with PDL may start while the kernel before it in the stream is still running:
its blocks take the multiprocessors that kernel's last blocks leave idle, load what no kernel of
the forward writes (weights), then wait (`wait_for_inputs`) until the previous kernel has ended
and its writes are visible. On a batch-1 decode step the ~10 kernel boundaries of each layer
otherwise leave the memory system idle for a few microseconds each: the ramp-down of one
kernel's last wave plus the next one's launch and first loads.

Rules every kernel here follows, so that chains of them stay correct:
- `start_dependents` first: the next kernel may be scheduled once every block of this one has
  started (a multi-wave grid reaches that in its last wave). Later where the next kernel's
  early loads would slow this one's latency-bound chain (`split_kv_decode`: after its
  products); never omitted, or the next kernel starts only when this one ends;
- before `wait_for_inputs`, read only weights and write nothing. Once it returns, every earlier
  kernel of the stream has ended: the previous one has, and it waited for its own predecessor.
cuBLAS and torch kernels launch without PDL and serialise as usual; FlashInfer's kernels use PDL
by their own default on Hopper and wait for their inputs the same way.
`EngineConfig.kernels.pdl = False` turns it off (for a comparison, or a driver that mishandles
it): the model runner passes it to `allow` at its start, on every rank.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from workers import env

# A process setting, not an argument: it would otherwise travel through every launch site of a
# forward (the model's layers, attention, sampling, the all-reduce) to reach `launch_options`.
_allowed = True


def allow(on: bool) -> None:
    """Whether this process's kernels may launch with PDL (`KernelConfig.pdl`); the model runner
    calls it once at its start, before the model loads (the norm folding asks `enabled`)."""
    global _allowed
    _allowed = on


@functools.cache
def _supported(device_index: int) -> bool:
    if env.triton_interpret():
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    if not hasattr(cuda, "gdc_wait"):  # a Triton without the PDL instructions
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL."""
    if device.type != "cuda" or not _allowed:
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(x: torch.Tensor) -> dict[str, bool]:
    """Keyword arguments for a launch of a kernel that takes the `PDL` constexpr."""
    if enabled(x.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}  # no launch_pdl: a Triton without PDL does not know the option


@triton.jit
def start_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
