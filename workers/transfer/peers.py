"""Peer records: what one agent must know to read another agent's KV pool.

A record holds the NIXL agent metadata (connection info and registered memory), where the pool
lies (`PoolRegion`), its `KVLayout` and, for a pool in VRAM, its CUDA IPC handle and GPU UUID
(`device_copy.IpcPool`: a reader on the same GPU copies pages device to device). Each agent
publishes its record once, keyed by its agent name, in Ray's internal KV store (namespace
`pdserve-nixl`); readers fetch it the first time they meet the name and cache it. Agent names
carry an incarnation id, so a record never goes stale under a live name: a restarted replica
publishes under a new name.

The record is JSON (the metadata base64-encoded): nothing read back from the store is unpickled.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

from workers.protocol import KVLayout
from workers.ray_kv import ray_internal_kv
from workers.transfer.descriptors import PoolRegion
from workers.transfer.device_copy import IpcPool
from workers.transfer.errors import PeerUnavailableError

logger = logging.getLogger(__name__)

KV_NAMESPACE = "pdserve-nixl"


@dataclass(frozen=True)
class PeerRecord:
    agent_name: str
    nixl_metadata: bytes
    region: PoolRegion
    layout: KVLayout
    generations: PoolRegion | None = None  # the page generation numbers, when tracked
    ipc: IpcPool | None = None  # the pool's CUDA IPC handle, for readers on its GPU

    def to_bytes(self) -> bytes:
        gens = None if self.generations is None else asdict(self.generations)
        return json.dumps(
            {
                "agent_name": self.agent_name,
                "nixl_metadata": base64.b64encode(self.nixl_metadata).decode("ascii"),
                "region": asdict(self.region),
                "layout": self.layout.model_dump(),
                "generations": gens,
                "ipc": None if self.ipc is None else self.ipc.to_dict(),
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerRecord:
        d = json.loads(data)
        gens, ipc = d.get("generations"), d.get("ipc")
        return cls(
            agent_name=d["agent_name"],
            nixl_metadata=base64.b64decode(d["nixl_metadata"]),
            region=PoolRegion(**d["region"]),
            layout=KVLayout(**d["layout"]),
            generations=None if gens is None else PoolRegion(**gens),
            ipc=None if ipc is None else IpcPool(**ipc),
        )


def ray_kv_available() -> bool:
    """True in a process connected to a Ray cluster (a driver after `ray.init`, or an actor)."""
    return ray_internal_kv() is not None


def publish(record: PeerRecord) -> bool:
    """Put the record under its agent name; False (and a log line) when Ray is not initialized."""
    kv = ray_internal_kv()
    if kv is None:
        logger.info("Ray is not initialized: NIXL agent %s not published", record.agent_name)
        return False
    data = record.to_bytes()
    kv._internal_kv_put(record.agent_name, data, overwrite=True, namespace=KV_NAMESPACE)
    return True


def fetch(agent_name: str) -> PeerRecord | None:
    """The record published under `agent_name`, or None if there is none (or no Ray)."""
    kv = ray_internal_kv()
    if kv is None:
        return None
    data = kv._internal_kv_get(agent_name, namespace=KV_NAMESPACE)
    return None if data is None else PeerRecord.from_bytes(data)


def unpublish(agent_name: str) -> None:
    kv = ray_internal_kv()
    if kv is not None:
        kv._internal_kv_del(agent_name, namespace=KV_NAMESPACE)


@dataclass
class Peer:
    record: PeerRecord
    dlist: Any = None  # the peer's pool as a prepped per-page dlist, made on first read
    pool: Any = None  # its pool tensor opened through CUDA IPC (same GPU), on first read
    pool_checked: bool = False  # whether that was tried


class PeerTable:
    """The peers loaded into one NIXL agent, by agent name; driven by that agent's thread.

    A name is looked up in Ray KV and its NIXL metadata loaded once, then cached until
    `forget`: there is no per-request handshake.
    """

    def __init__(self, nixl_agent: Any) -> None:
        self._nixl = nixl_agent
        self._peers: dict[str, Peer] = {}

    def get(self, agent_name: str) -> Peer:
        if agent_name in self._peers:
            return self._peers[agent_name]
        record = fetch(agent_name)
        if record is None:
            raise PeerUnavailableError(
                f"no NIXL metadata for agent {agent_name!r} (not published in Ray KV "
                f"namespace {KV_NAMESPACE!r}, and not added with add_peer)"
            )
        return self.load(record)

    def load(self, record: PeerRecord) -> Peer:
        if record.agent_name in self._peers:
            return self._peers[record.agent_name]
        try:
            loaded = self._nixl.add_remote_agent(record.nixl_metadata)
        except Exception as e:  # UCX connects while loading: a dead peer fails here
            raise PeerUnavailableError(f"cannot load NIXL agent {record.agent_name}: {e!r}") from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != record.agent_name:
            raise PeerUnavailableError(f"record {record.agent_name} holds metadata of {loaded}")
        peer = self._peers[record.agent_name] = Peer(record)
        logger.info("NIXL peer %s loaded (%s)", record.agent_name, record.region.mem_type)
        return peer

    def forget(self, agent_name: str) -> None:
        peer = self._peers.pop(agent_name, None)
        if peer is None:
            return
        if peer.dlist is not None:
            peer.dlist.release()
        try:
            self._nixl.remove_remote_agent(agent_name)
        except Exception as e:  # already disconnected: nothing left to undo
            logger.debug("remove_remote_agent(%s): %r", agent_name, e)

    def forget_all(self) -> None:
        for name in list(self._peers):
            self.forget(name)
