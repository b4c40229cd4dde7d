"""Choosing the same-GPU KV path (CUDA IPC device copies) over NIXL, and counting it, without a
GPU."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from router.backend import RoleStats
from router.metric_names import Naming
from router.metrics import Metrics
from tests.engine_checks import engine_pair, prefill_then_decode
from workers import LLM, SamplingParams
from workers.config import EngineConfig, KVTransferConfig
from workers.protocol import GenerateRequest, KVLayout
from workers.transfer.descriptors import PoolRegion
from workers.transfer.device_copy import PROCESS_ID, DeviceCopy, IpcPool, export_pool, same_gpu
from workers.transfer.peers import PeerRecord

PROMPT = list(range(500, 540))  # 3 pages of 16
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


class DoneEvent:
    """A CUDA event that has already fired."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostCopies:
    """`DeviceCopies` for a pool in host memory: the same page copies, done at once."""

    def __init__(self, pages: torch.Tensor) -> None:
        self.pages = pages

    def copy(self, remote: torch.Tensor, local: np.ndarray, remote_ids: np.ndarray) -> DeviceCopy:
        self.pages[torch.from_numpy(local)] = remote[torch.from_numpy(remote_ids)]
        return DeviceCopy(DoneEvent())  # type: ignore[arg-type]


def test_a_same_gpu_handoff_counts_a_device_copy_and_metrics_export_it(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hand-off over NIXL counts no device copy; one whose peer shares the GPU (its pool
    opened through IPC, here a host tensor) copies the pages itself, counts one and gives the
    same tokens; /metrics exports the count."""
    cfg = EngineConfig(model=tiny_llama, num_kv_pages=32, page_size=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with engine_pair(cfg) as (prefill, decode):
        over_nixl = prefill_then_decode(
            prefill, decode, GenerateRequest(request_id="a", prompt_token_ids=PROMPT, params=params)
        )
        assert decode.stats().kv_device_copies == 0
        monkeypatch.setattr(decode.agent, "_copies", HostCopies(decode.runner.pool.pages))
        monkeypatch.setattr(decode.agent, "_same_gpu_pool", lambda peer: prefill.runner.pool.pages)
        # another prompt of the same length: the decode's prefix cache holds none of its pages
        other = [t + 1 for t in PROMPT]
        copied = prefill_then_decode(
            prefill, decode, GenerateRequest(request_id="b", prompt_token_ids=other, params=params)
        )
        stats = decode.stats()
        assert stats.kv_device_copies == 1 and stats.nixl_transfers == 2
        assert stats.num_recomputed == 0 and stats.kv_pages_read == 6
        [ref_a, ref_b] = LLM(tiny_llama, num_kv_pages=32, page_size=16).generate(
            [PROMPT, other], params
        )
        assert (over_nixl, copied) == (ref_a.token_ids, ref_b.token_ids)
    text = Metrics("m").render([RoleStats("decode", stats)]).decode()
    assert 'pdserve:kv_transfer_device_copies_total{model_name="m",role="decode"} 1.0' in text
    vllm = Metrics("m", naming=Naming("vllm")).render([RoleStats("decode", stats)]).decode()
    assert 'vllm:kv_transfer_device_copies_total{engine="decode",model_name="m"} 1.0' in vllm
