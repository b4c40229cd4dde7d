"""The config schema as a markdown reference: every field of `AppConfig` and of the models nested
in it, with its type, bounds, default and description. `docs/configuration.md` is this text
(`pdserve schema --markdown`); a unit test keeps the two equal."""

from __future__ import annotations

import json
import types
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from cluster.config import AppConfig

REGENERATE = "pdserve schema --markdown > docs/configuration.md"

INTRO = f"""\
# Configuration

Generated from the config schema (`cluster/config.py`, `cluster/pool_config.py`,
`workers/config/`) by
`{REGENERATE}`;
do not edit it by hand. A unit test fails when the two differ.

Every knob is a field of `AppConfig`: the `args` of each application in a Serve config file whose
`import_path` is `cluster.app:build_app` (see `configs/`). Nested fields are set in the file as
nested mappings, or on the command line by their dotted path:
`pdserve serve configs/local.yaml --set engine.page_size=32 --set decode.num_replicas=2`.
`pdserve check CONFIG` validates a file without deploying; an unknown or mistyped field fails
naming it. Defaults are written as in YAML (`null` is none).
"""

_BOUNDS = ((at.Ge, "ge", "≥"), (at.Gt, "gt", ">"), (at.Le, "le", "≤"), (at.Lt, "lt", "<"))


def type_name(tp: Any) -> str:
    """A field's annotation as written in Python, e.g. `int | None`, `"torch" | "flashinfer"`."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is type(None):
        return "None"
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    return getattr(tp, "__name__", str(tp))


def nested_models(tp: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation names (itself, or inside `X | None`, `list[X]`, ...)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for a in get_args(tp) for m in nested_models(a)]


def bounds(field: FieldInfo) -> str:
    return ", ".join(
        f"{sign} {getattr(m, attr)}"
        for m in field.metadata
        for kind, attr, sign in _BOUNDS
        if isinstance(m, kind)
    )


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return f"see [{type(value).__name__}](#{type(value).__name__.lower()})"
    return f"`{json.dumps(value)}`"


def field_row(name: str, field: FieldInfo) -> str:
    kind = f"`{type_name(field.annotation)}`"
    models = nested_models(field.annotation)
    if models:
        kind = ", ".join(f"[{m.__name__}](#{m.__name__.lower()})" for m in models)
        kind += " or `null`" if type(None) in get_args(field.annotation) else ""
    if bound := bounds(field):
        kind += f", {bound}"
    return f"| `{name}` | {cell(kind)} | {cell(default(field))} | {cell(field.description or '')} |"


def model_paths(root: type[BaseModel]) -> dict[type[BaseModel], list[str]]:
    """Each model reachable from `root`, in order of discovery, with the dotted paths to it."""
    paths: dict[type[BaseModel], list[str]] = {root: []}
    queue = [(root, "")]
    while queue:
        model, prefix = queue.pop(0)
        for name, field in model.model_fields.items():
            for sub in nested_models(field.annotation):
                paths.setdefault(sub, []).append(prefix + name)
                queue.append((sub, f"{prefix}{name}."))
    return paths


def model_section(model: type[BaseModel], paths: list[str]) -> str:
    where = ", ".join(f"`{p}`" for p in paths) or "the application's `args`"
    lines = [f"## {model.__name__}", "", f"Set at: {where}.", ""]
    if model.__doc__:
        lines += [" ".join(model.__doc__.split()), ""]
    lines += ["| Field | Type | Default | Description |", "| --- | --- | --- | --- |"]
    lines += [field_row(name, field) for name, field in model.model_fields.items()]
    return "\n".join(lines) + "\n"


def schema_markdown(root: type[BaseModel] = AppConfig) -> str:
    """The markdown reference of `root`'s fields and every model nested in it."""
    sections = [model_section(m, p) for m, p in model_paths(root).items()]
    return "\n".join([INTRO, *sections])
