"""One application per serving mode in one Ray + Serve instance, for a module fixture."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ray import serve

from cluster.app import build_app
from tests.conftest import local_ray
from workers.parallel.rendezvous import free_port

MODES = ("disaggregated", "colocated")


def mode_apps(args_of: Callable[[str], dict[str, Any]]) -> Iterator[dict[str, str]]:
    """Deploy each mode's app (config `args_of(mode)`) under /<mode>; yield each one's base URL.
    Starting Ray and Serve costs ~30 s, so a module starts them once for all its apps."""
    for _ in local_ray(num_cpus=2):
        port = free_port("127.0.0.1")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            for mode in MODES:
                serve.run(build_app(args_of(mode)), name=mode, route_prefix=f"/{mode}")
            yield {mode: f"http://127.0.0.1:{port}/{mode}" for mode in MODES}
        finally:
            serve.shutdown()
