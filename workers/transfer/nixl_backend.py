"""NIXL's Python API, from the backend wheel built for this process's CUDA.

pdserve depends on a NIXL backend wheel (`nixl-cu13`; `nixl-cu12` through the `cu12` extra)
rather than on NIXL's `nixl` meta package, which installs both (127 MB) in order to pick one
at import time. The pick here is the meta package's: the wheel of torch's CUDA major version,
or whichever is installed under a CPU build of torch (both move DRAM pages over UCX).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch


def backend_modules() -> tuple[str, ...]:
    """The backend modules that fit this process, best first."""
    cuda = torch.version.cuda
    if cuda:
        return (f"nixl_cu{cuda.split('.')[0]}",)
    return ("nixl_cu13", "nixl_cu12")


def load_nixl() -> ModuleType:
    """The backend's API (`nixl_agent`, `nixl_agent_config`, ...); ImportError naming the wheel
    to install when none is there."""
    names = backend_modules()
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # the wheel is there but broken: say so
                raise
    wheels = " or ".join(n.replace("_", "-") for n in names)
    raise ImportError(
        f"no NIXL backend for torch {torch.__version__}: install {wheels} "
        "(pdserve[cu12] for a CUDA 12 build of torch)"
    )
