"""`pdserve`: check a Serve config file, list every knob, or serve with overrides.

    pdserve check configs/llama.yaml      validate each pdserve application's `args` (AppConfig)
                  [--address ADDR|none]   without deploying: exit 1 naming every bad field (a
                                          KubeRay RayService: its serveConfigV2); print each
                                          pool's resources against the Ray cluster's (ADDR,
                                          default $RAY_ADDRESS or one started on this machine)
                                          and warn of replicas it cannot place
    pdserve schema [--markdown]           every knob of AppConfig with its default and meaning: JSON
                                          schema, or the markdown of docs/configuration.md
    pdserve serve CONFIG [--set engine.model=/models/x --set decode.num_replicas=2 ...]
                  [--host H] [--port P]   `serve run CONFIG` with these overrides of the args
                                          and of its http_options

A pdserve application is one whose `import_path` is `cluster.app:build_app`; `--set` changes
the args of every such application in the file, its value read as YAML (`2`, `true`, `[1, 2]`).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cluster import resources
from cluster.config import AppConfig
from cluster.schema_doc import schema_markdown

IMPORT_PATH = "cluster.app:build_app"
SHUTDOWN_TIMEOUT_S = 20.0  # each of Serve's and Ray's parts of Ctrl-C


def pdserve_apps(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The applications of a Serve config that `build_app` builds."""
    return [a for a in config.get("applications") or [] if a.get("import_path") == IMPORT_PATH]


def apply_overrides(args: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """`args` with each `dotted.path=value` set (value parsed as YAML); a copy."""
    out = copy.deepcopy(args)
    for assignment in assignments:
        path, sep, value = assignment.partition("=")
        if not sep or not path:
            raise ValueError(f"--set wants PATH=VALUE, got {assignment!r}")
        *parents, leaf = path.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {path}: {key} is not a mapping")
        node[leaf] = yaml.safe_load(value)
    return out


def serve_configs(path: Path) -> list[dict[str, Any]]:
    """The Serve configs in a file: the file itself, or each KubeRay RayService's
    `spec.serveConfigV2` (a YAML string) among its documents."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    services = [d for d in docs if d.get("kind") == "RayService"]
    if services:
        return [yaml.safe_load(d.get("spec", {}).get("serveConfigV2") or "{}") for d in services]
    return docs


def cluster_nodes(address: str) -> tuple[list[resources.Resources] | None, str]:
    """The Ray cluster's nodes' resources, connecting to `address` ("none": not at all), and
    a line saying where they come from."""
    if address == "none":
        return None, "Ray cluster: not connected (--address none): demand only"
    import ray

    if not ray.is_initialized():
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        except ConnectionError as e:
            return None, f"Ray cluster: not connected ({e}): demand only"
    where = ray.get_runtime_context().gcs_address
    nodes = resources.ray_nodes()
    totals = {k: v for k, v in ray.cluster_resources().items() if "node:" not in k}
    return nodes, f"Ray cluster at {where}: ray.cluster_resources() = {totals}"


def check(paths: list[Path], address: str = "none") -> int:
    """Validate every pdserve application's args in `paths`; print what is wrong, and what
    each valid application asks of the Ray cluster at `address` (warnings do not fail it)."""
    status = 0
    valid: list[tuple[str, AppConfig]] = []
    for path in paths:
        apps = [app for config in serve_configs(path) for app in pdserve_apps(config)]
        if not apps:
            print(f"{path}: no application imports {IMPORT_PATH}")
            status = 1
        for app in apps:
            name = f"{path}: application {app.get('name')!r}"
            try:
                valid.append((name, AppConfig.model_validate(app.get("args") or {})))
                print(f"{name}: ok")
            except ValidationError as e:
                print(f"{name}: {e}")
                status = 1
    if valid:
        nodes, source = cluster_nodes(address)
        print(source)
        for name, cfg in valid:
            lines, warnings = resources.report(cfg, nodes)
            print(f"{name}: resources")
            for line in lines:
                print(f"  {line}")
            for warning in warnings:
                print(f"  WARNING: {warning}")
    return status


def schema() -> str:
    """AppConfig's JSON schema: every field, its type, default and description."""
    return json.dumps(AppConfig.model_json_schema(), indent=2)


def serve_config(
    path: Path, assignments: list[str], http: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The Serve config to run: the file with `http` over its http_options and the overrides
    applied to each pdserve application's args, which are validated here so a typo fails
    before Ray starts."""
    config = yaml.safe_load(path.read_text()) or {}
    config["http_options"] = {**(config.get("http_options") or {}), **(http or {})}
    apps = pdserve_apps(config)
    if not apps:
        raise ValueError(f"{path}: no application imports {IMPORT_PATH}")
    for app in apps:
        app["args"] = apply_overrides(app.get("args") or {}, assignments)
        AppConfig.model_validate(app["args"])
    return config


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM (what Kubernetes sends a pod) both stop the server, also where SIGINT
    was ignored when the process started (a shell's background job), which would leave Python
    without its Ctrl-C handler."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def serve(config: dict[str, Any]) -> None:
    """Start each pdserve application of `config` (from `serve_config`; no other application
    of the file) and block until Ctrl-C."""
    import ray
    from ray import serve as ray_serve

    from cluster.app import build_app

    http = config["http_options"]  # serve_config sets it
    ray.init()
    ray_serve.start(proxy_location=config.get("proxy_location"), http_options=http)
    _stop_on_signals()
    try:
        for app in pdserve_apps(config):
            ray_serve.run(
                build_app(app["args"]),
                name=app.get("name", "pdserve"),
                route_prefix=app.get("route_prefix", "/"),
            )
        print(f"pdserve is up on {http.get('host', '127.0.0.1')}:{http.get('port', 8000)}")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        # Ctrl-C reaches Serve's controller and Ray's own processes too (one process group):
        # Serve's and Ray's shutdown calls can then wait for ever (as can Ray's exit hook), so
        # each gets a bound and the process ends when both are done or out of time.
        for step in (ray_serve.shutdown, ray.shutdown):
            stopping = threading.Thread(target=step, daemon=True)
            stopping.start()
            stopping.join(SHUTDOWN_TIMEOUT_S)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p_check = sub.add_parser("check", help="validate Serve config files without deploying")
    p_check.add_argument("configs", nargs="+", type=Path)
    # "auto": Ray itself takes $RAY_ADDRESS first, else a cluster started on this machine
    p_check.add_argument("--address", default="auto",
                         help="Ray cluster whose resources to check against (default: "
                         "$RAY_ADDRESS, else one started on this machine; none: do not "
                         "connect)")  # fmt: skip
    p_schema = sub.add_parser("schema", help="print every knob of the application config")
    p_schema.add_argument("--markdown", action="store_true",
                          help="as markdown (docs/configuration.md), not JSON schema")  # fmt: skip
    p_serve = sub.add_parser("serve", help="serve a config file with overrides")
    p_serve.add_argument("config", type=Path)
    p_serve.add_argument("--set", dest="assignments", action="append", default=[],
                         metavar="PATH=VALUE", help="override an application arg")  # fmt: skip
    p_serve.add_argument("--host", help="HTTP address (the config's http_options.host)")
    p_serve.add_argument("--port", type=int, help="HTTP port (the config's http_options.port)")
    args = ap.parse_args(argv)
    if args.command == "check":
        return check(args.configs, args.address)
    if args.command == "schema":
        sys.stdout.write(schema_markdown() if args.markdown else schema() + "\n")
        return 0
    try:
        http = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        config = serve_config(args.config, args.assignments, http)
    except (ValueError, ValidationError) as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
