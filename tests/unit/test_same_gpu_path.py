"""Choosing the same-GPU KV path (CUDA IPC device copies) over NIXL, without a GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from workers.config import KVTransferConfig
from workers.protocol import KVLayout
from workers.transfer.descriptors import PoolRegion
from workers.transfer.device_copy import PROCESS_ID, IpcPool, export_pool, same_gpu
from workers.transfer.peers import PeerRecord

GPU = "GPU-6f1c3a52-0d8e-4f0b-9c1e-0123456789ab"
OTHER_PROCESS = IpcPool(
    device_uuid=GPU, process_id="a-replica-elsewhere", size=[8, 2, 2, 16, 8, 128],
    stride=[65536, 32768, 16384, 1024, 128, 1], offset=0, dtype="bfloat16", handle="aGFuZGxl",
    storage_bytes=1 << 20, storage_offset=0, ref_counter_handle="L3RvcmNo", ref_counter_offset=3,
    event_handle="ZXZlbnQ=", event_sync_required=True,
)  # fmt: skip


def test_a_peer_on_our_gpu_in_another_process_is_copied_through_ipc() -> None:
    assert same_gpu(GPU, OTHER_PROCESS)


@pytest.mark.parametrize(
    ("local_uuid", "remote", "why"),
    [
        ("GPU-another-card", OTHER_PROCESS, "another GPU: NVLink/RDMA through NIXL"),
        (None, OTHER_PROCESS, "our pool is in host memory"),
        (GPU, None, "the peer exported no handle (CPU pool, or IPC refused)"),
        (GPU, replace(OTHER_PROCESS, process_id=PROCESS_ID), "this process: CUDA cannot open it"),
    ],
)
def test_other_peers_stay_on_nixl(local_uuid: str | None, remote: IpcPool | None, why: str) -> None:
    assert not same_gpu(local_uuid, remote), why


def test_the_ipc_handle_survives_the_peer_record_json() -> None:
    layout = KVLayout(num_layers=2, page_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    region = PoolRegion(base_addr=4096, num_pages=8, page_bytes=layout.page_bytes, dev_id=0,
                        mem_type="VRAM")  # fmt: skip
    record = PeerRecord("prefill-x-rank0-1", b"\x00nixl", region, layout, None, OTHER_PROCESS)
    back = PeerRecord.from_bytes(record.to_bytes())
    assert back == record and back.ipc == OTHER_PROCESS
    legacy = PeerRecord("p", b"m", region, layout)  # a CPU pool: no handle at all
    assert PeerRecord.from_bytes(legacy.to_bytes()).ipc is None


def test_a_cpu_pool_exports_no_handle() -> None:
    assert export_pool(torch.zeros(4, 16)) is None


def test_the_knob_defaults_to_auto_and_refuses_other_values() -> None:
    assert KVTransferConfig().same_gpu == "auto"
    assert KVTransferConfig(same_gpu="nixl").same_gpu == "nixl"
    with pytest.raises(ValueError, match="same_gpu"):
        KVTransferConfig(same_gpu="tcp")  # type: ignore[arg-type]
