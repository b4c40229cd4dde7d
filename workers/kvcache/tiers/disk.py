"""The disk tier: one file per KV page under `kv_offload.disk_dir`.

A file is `PDKV`, its header's length (4 bytes, little-endian), the header (JSON: who wrote it
(`meta`: model, weights, dtypes, page layout, TP rank) and the page's name, parent and tokens),
then the page's bytes as the pool holds them (FP8 stays FP8). File names start with a digest of
`meta`, so replicas of different models can share a directory; a replica that starts scans the
files with its own digest, checks each header, and takes the matching ones as its tier (oldest
first by modification time), leaving every other file alone. Files are written to a temporary
name and renamed, so a replica killed mid-write leaves no torn page.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

import torch

from workers.kvcache.tiers.index import TierEntry, TierIndex

logger = logging.getLogger(__name__)
MAGIC = b"PDKV"


class DiskTier(TierIndex):
    def __init__(
        self, directory: str, capacity: int, page_bytes: int, meta: dict[str, Any]
    ) -> None:
        if capacity < 1:
            raise ValueError(
                f"kv_offload.disk_gb holds no page: a page is {page_bytes / 2**20:.2f} MiB"
            )
        super().__init__(capacity)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.page_bytes = page_bytes
        self.meta = json.loads(json.dumps(meta))  # as a header reads back (tuples: lists)
        digest = hashlib.blake2b(json.dumps(meta, sort_keys=True).encode(), digest_size=8)
        self.prefix = digest.hexdigest()
        self.num_ignored = self._scan()

    def path(self, name: int) -> Path:
        return self.dir / f"{self.prefix}-{name & (2**64 - 1):016x}.kv"

    def write(self, entry: TierEntry, data: torch.Tensor) -> None:
        """Store a page (on the tiers' I/O thread)."""
        header = json.dumps(
            {
                "meta": self.meta,
                "name": entry.name,
                "parent": entry.parent,
                "tokens": list(entry.tokens),
            }  # fmt: skip
        ).encode()
        path = self.path(entry.name)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header)
            f.write(data.numpy().tobytes())
        os.replace(tmp, path)

    def read(self, entry: TierEntry) -> torch.Tensor:
        """A page's bytes (on the tiers' I/O thread)."""
        with open(self.path(entry.name), "rb") as f:
            head = f.read(8)
            f.seek(8 + struct.unpack("<I", head[4:])[0])
            body = f.read()
        if len(body) != self.page_bytes:
            raise OSError(
                f"{self.path(entry.name)}: {len(body)} bytes, a page is {self.page_bytes}"
            )
        return torch.frombuffer(bytearray(body), dtype=torch.uint8)

    def delete(self, entry: TierEntry) -> None:
        self.path(entry.name).unlink(missing_ok=True)

    def _scan(self) -> int:
        """Take this replica's files from an earlier run; return how many were not ours."""
        found, ignored = [], 0
        for path in self.dir.glob(f"{self.prefix}-*.kv"):
            header = _header(path)
            size_ok = header is not None and path.stat().st_size == header[1] + self.page_bytes
            if header is None or header[0].get("meta") != self.meta or not size_ok:
                ignored += 1
                continue
            h = header[0]
            found.append(
                (path.stat().st_mtime, TierEntry(h["name"], h["parent"], tuple(h["tokens"])))
            )
        found.sort(key=lambda f: f[0])
        for _, entry in found[-self.capacity :]:
            self.add(entry)
        if found or ignored:
            logger.info("disk KV tier %s: %d pages reused, %d files of others ignored",
                        self.dir, len(self), ignored)  # fmt: skip
        return ignored


def _header(path: Path) -> tuple[dict[str, Any], int] | None:
    """A file's header and the offset of its page bytes, or None if it is not a page file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8 or head[:4] != MAGIC:
                return None
            (length,) = struct.unpack("<I", head[4:])
            return json.loads(f.read(length)), 8 + length
    except (OSError, ValueError):
        return None
