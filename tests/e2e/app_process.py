"""A Serve application in a process of its own (`serve run`, `pdserve serve`), for the tests
that start one the way a user does."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
START_DEADLINE_S = 240


@contextmanager
def app_process(
    command: list[str], cwd: Path, log: Path, base_url: str
) -> Iterator[subprocess.Popen]:
    """Run `command` (its output to `log`) in its own process group importing this checkout;
    yield the process once `base_url/health` answers 200. On exit: SIGKILL unless it has ended
    (a test that checks Ctrl-C sends it itself), then `ray stop`: the modules using this run
    before the shared cluster starts (`own_ray`)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip

    def healthy() -> bool:
        assert proc.poll() is None, f"{command[0]} exited: {log.read_text()[-3000:]}"
        try:
            return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, START_DEADLINE_S, interval_s=1, what=f"{base_url}/health to answer")
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=60)
