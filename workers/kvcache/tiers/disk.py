"""The disk tier's files: one per KV page under `kv_offload.disk_dir`.

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

from workers.kvcache.tiers.index import TierEntry

logger = logging.getLogger(__name__)
MAGIC = b"PDKV"


class PageFiles:
    """One rank's page files (its `meta` names the TP rank): written, read and deleted on the
    tiers' I/O thread."""

    def __init__(self, directory: str, page_bytes: int, meta: dict[str, Any]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.page_bytes = page_bytes
        self.meta = json.loads(json.dumps(meta))  # as a header reads back (tuples: lists)
        digest = hashlib.blake2b(json.dumps(meta, sort_keys=True).encode(), digest_size=8)
        self.prefix = digest.hexdigest()

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

    def read_into(self, entry: TierEntry, out: torch.Tensor) -> None:
        """A page's bytes into `out` (a row of a staging buffer; on the tiers' I/O thread)."""
        with open(self.path(entry.name), "rb") as f:
            head = f.read(8)
            f.seek(8 + struct.unpack("<I", head[4:])[0])
            got = f.readinto(out.numpy().data)
            extra = len(f.read(1))
        if got != self.page_bytes or extra:
            raise OSError(f"{self.path(entry.name)}: not {self.page_bytes} bytes of page")

    def delete(self, entry: TierEntry) -> None:
        self.path(entry.name).unlink(missing_ok=True)

    def scan(self, capacity: int) -> list[TierEntry]:
        """This replica's pages from an earlier run, oldest first, at most `capacity` (the
        newest); files whose header is not this replica's are left alone."""
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
        if found or ignored:
            logger.info("disk KV tier %s: %d pages reused, %d files with our name ignored",
                        self.dir, min(len(found), capacity), ignored)  # fmt: skip
        return [entry for _, entry in found[-capacity:]] if capacity else []


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
