"""A Ray cluster of several nodes on this machine, started the way one is started on a real
cluster: `ray start --head`, then `ray start --address=...` for each worker node with custom
resources of its own, so that a pool pinned to a node type (`PoolConfig.resources`) lands there.

Each node runs in its own `ray start --block` process group with its own temp dir: two nodes
started at once in one temp dir race for the same socket names, and the head's own temp dir
keeps its address out of /tmp/ray, where a plain `ray.init()` elsewhere would find it. Stopping
signals those processes only (`ray stop` would stop every Ray on the machine).

Token authentication is off (`RAY_AUTH_MODE=disabled`) on these nodes: a process reads the mode
once, when it loads Ray, so the test process could not switch to it; with a token in
~/.ray/auth_token and the mode unset, `ray start --head` would turn it on by itself.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.waiting import wait_until
from workers.parallel.rendezvous import free_port

START_DEADLINE_S = 180  # three nodes on 2 busy cores take 30-40 s
STOP_GRACE_S = 30  # SIGTERM first (each node stops its own processes), then SIGKILL
PR_SET_PDEATHSIG = 1  # prctl(2)
NODE_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # SIGTERM stops a node at once
    # A raylet waits this long for its agents' port files, then crashes; three nodes' agents
    # starting at once on a busy 2-core machine take longer than the 30 s default.
    "RAY_agent_register_timeout_ms": "180000",
    "RAY_raylet_start_wait_time_s": "180",  # `ray start` waiting for its raylet, likewise
}


def _end_with_parent() -> None:
    """In the child before `exec`: SIGTERM it when the test process dies, however it dies (a
    killed test run leaves no Ray behind; `ray start --block` stops its node on SIGTERM)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Node:
    """One `ray start --block` process, the node's processes in its process group."""

    proc: subprocess.Popen
    temp_dir: Path

    @property
    def log(self) -> Path:
        return self.temp_dir / "ray-start.log"

    def check_running(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log.read_text()[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"`ray start` exited ({self.proc.returncode}):\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class LocalCluster:
    """A head of `head_cpus` CPUs and one worker node per entry of `workers` (custom resources
    -> the node's CPUs). `start()` returns the head's address once every node is alive."""

    def __init__(self, head_cpus: int, workers: dict[str, int], node_resource: float = 100):
        self.head_cpus = head_cpus
        self.workers = workers
        self.node_resource = node_resource
        self.port = free_port("127.0.0.1")
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[Node] = []

    def _start_node(self, *args: str) -> Node:
        temp_dir = Path(tempfile.mkdtemp(prefix="pdray-"))  # short: socket paths live under it
        env = {**os.environ, **NODE_ENV}
        command = ["ray", "start", "--block", "--disable-usage-stats", f"--temp-dir={temp_dir}",
                   # nodes on one machine share its ports: no fixed agent port, OS-picked
                   # worker ports
                   f"--dashboard-agent-listen-port={free_port('127.0.0.1')}",
                   "--min-worker-port=0", "--max-worker-port=0", *args]  # fmt: skip
        with open(temp_dir / "ray-start.log", "w") as log:
            proc = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_end_with_parent,
            )  # fmt: skip
        node = Node(proc, temp_dir)
        self.nodes.append(node)
        return node

    def _gcs_listening(self) -> bool:
        self.nodes[0].check_running()
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def start(self) -> str:
        """Start the nodes (the workers once the head's GCS listens): the head's address."""
        self._start_node("--head", f"--port={self.port}", f"--num-cpus={self.head_cpus}",
                         "--include-dashboard=false",
                         f"--ray-client-server-port={free_port('127.0.0.1')}")  # fmt: skip
        wait_until(self._gcs_listening, START_DEADLINE_S, interval_s=0.2, what="the head's GCS")
        for resource, cpus in self.workers.items():
            self._start_node(
                f"--address={self.address}",
                f"--num-cpus={cpus}",
                "--num-gpus=0",  # the machine's GPUs are the head's: one node counts them
                f"--resources={json.dumps({resource: self.node_resource})}",
            )
        return self.address

    def wait_alive(self) -> None:
        """Every node registered and alive (call once connected: `ray.nodes()`)."""
        import ray

        def alive() -> bool:
            for node in self.nodes:
                node.check_running()
            return sum(n["Alive"] for n in ray.nodes()) == len(self.nodes)

        wait_until(alive, START_DEADLINE_S, interval_s=0.5, what=f"{len(self.nodes)} Ray nodes")

    def stop(self) -> None:
        for node in reversed(self.nodes):  # workers first: the head's GCS outlives them
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            node.stop()
