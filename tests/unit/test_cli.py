"""`pdserve check / schema / serve`: config files validated without deploying, overrides."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from cluster import cli, schema_doc

REPO = Path(__file__).resolve().parents[2]


def test_the_console_script_is_the_cli() -> None:
    [script] = [e for e in entry_points(group="console_scripts") if e.name == "pdserve"]
    assert script.load() is cli.main


def test_check_passes_the_shipped_configs(capsys: pytest.CaptureFixture[str]) -> None:
    paths = [REPO / "configs" / "local.yaml", REPO / "configs" / "llama.yaml"]
    paths.append(REPO / "deploy" / "kuberay" / "rayservice.yaml")  # its serveConfigV2
    assert cli.main(["check", "--address", "none", *map(str, paths)]) == 0
    assert capsys.readouterr().out.count(": ok") == 3


def test_check_reads_a_rayservice_serve_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    service = yaml.safe_load((REPO / "deploy" / "kuberay" / "rayservice.yaml").read_text())
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    config["applications"][0]["args"]["engine"]["page_sise"] = 16
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    path = tmp_path / "rayservice.yaml"
    path.write_text(yaml.safe_dump(service))
    assert cli.main(["check", "--address", "none", str(path)]) == 1
    assert "engine.page_sise" in capsys.readouterr().out


def test_check_names_a_misspelt_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    config["applications"][0]["args"]["decode"]["num_replica"] = 2
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["check", "--address", "none", str(path)]) == 1
    assert "decode.num_replica" in capsys.readouterr().out


def test_check_fails_a_file_without_a_pdserve_app(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump({"applications": [{"import_path": "x:y", "args": {}}]}))
    assert cli.main(["check", "--address", "none", str(path)]) == 1
    assert "no application imports cluster.app:build_app" in capsys.readouterr().out


def test_schema_lists_every_knob_with_its_meaning(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    router = schema["$defs"]["RouterConfig"]["properties"]
    assert router["decode_prefill_max_tokens"]["default"] == 0
    assert "prefill pool" in router["decode_prefill_max_tokens"]["description"]
    assert set(schema["properties"]) >= {"engine", "prefill", "decode", "router", "kv_transfer"}


def test_configuration_doc_is_the_schema_as_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/configuration.md never drifts from the schema: regenerate it with the command."""
    assert cli.main(["schema", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| `decode_prefill_max_tokens` | `int`, ≥ 0 | `0` |" in out
    assert "Set at: `prefill.autoscaling`, `decode.autoscaling`." in out
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert doc == out, "docs/configuration.md is stale: run " + schema_doc.REGENERATE


def test_overrides_set_typed_values_on_a_copy() -> None:
    args = {"engine": {"model": "m"}}
    out = cli.apply_overrides(args, ["engine.dtype=float32", "decode.num_replicas=2",
                                     "router.prefix_aware=false"])  # fmt: skip
    assert out == {
        "engine": {"model": "m", "dtype": "float32"},
        "decode": {"num_replicas": 2},
        "router": {"prefix_aware": False},
    }
    assert args == {"engine": {"model": "m"}}
    for bad in ("engine", "=3", "engine.model.x=1"):
        with pytest.raises(ValueError, match="--set"):
            cli.apply_overrides(args, [bad])


def test_serve_config_applies_overrides_and_validates_before_ray() -> None:
    config = cli.serve_config(
        REPO / "configs" / "local.yaml", ["engine.max_model_len=384"], {"port": 8123}
    )
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8123}
    [app] = config["applications"]
    assert app["args"]["engine"]["max_model_len"] == 384
    local = str(REPO / "configs" / "local.yaml")
    with pytest.raises(ValidationError, match="engine.dtyp"):
        cli.serve_config(Path(local), ["engine.dtyp=float32"])
    assert cli.main(["serve", local, "--set", "engine.dtyp=float32"]) == 2
