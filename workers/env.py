"""Every environment variable that cluster/, router/ and workers/ read, each behind a function.

Knobs live in the config schema (`EngineConfig`, `AppConfig`), which reaches every replica and
rank; what stays here is the environment's own business: where files are cached, a secret,
the import path handed to Ray workers, and Triton's interpreter mode.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted and downloaded models are kept: `$PDSERVE_CACHE`, else ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_CACHE", "~/.cache/pdserve")).expanduser()


def api_key() -> str | None:
    """The bearer token the router requires when its config names none: `$PDSERVE_API_KEY`."""
    return os.environ.get("PDSERVE_API_KEY") or None


def python_path(*first: str) -> str:
    """`first` ahead of this process's `$PYTHONPATH`, for the runtime env of Ray workers."""
    return os.pathsep.join(p for p in (*first, os.environ.get("PYTHONPATH")) if p)


def triton_interpret() -> bool:
    """Whether Triton runs kernels in its interpreter (`TRITON_INTERPRET=1`, on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
