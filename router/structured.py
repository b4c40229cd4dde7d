"""A request's constraint fields (`router.structured_fields`) and tool plan into the engine's
`structured_outputs` and `allowed_token_ids`, each checked here so a bad one is a 400 that names
the field and the problem, before any engine sees it.

At most one constraint per request: `response_format` (other than text), `structured_outputs`,
one `guided_*` field, or a tool_choice the grammar enforces (`required`, a named function).
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
from pydantic import ValidationError

from router.errors import BadRequestError
from router.structured_fields import StructuredFields
from router.tokenizer import Prompts
from router.tools.choice import ToolPlan
from workers.api import StructuredOutputs
from workers.api import check_structured_outputs as engine_check


def constraint_params(req: StructuredFields, prompts: Prompts,
                      plan: ToolPlan | None = None) -> dict[str, Any]:
    """The SamplingParams fields for the request's constraints (empty when it has none)."""
    out: dict[str, Any] = {}
    spec = structured_outputs(req, prompts, plan)
    if spec is not None:
        out["structured_outputs"] = spec
    if req.allowed_token_ids is not None:
        out["allowed_token_ids"] = _allowed(req.allowed_token_ids, prompts.vocab_size)
    if plan is not None and plan.choice == "auto":
        out["skip_special_tokens"] = False  # the call markers are special tokens in some families
    return out


def structured_outputs(req: StructuredFields, prompts: Prompts, plan: ToolPlan | None = None
                       ) -> StructuredOutputs | None:
    asked = _asked(req)
    if plan is not None and plan.schema is not None:
        asked["tool_choice"] = {"json": plan.schema}
    if len(asked) > 1:
        raise BadRequestError(f"one constraint per request, got {len(asked)}: "
                              f"{', '.join(asked)}", param=list(asked)[1])
    if not asked:
        return None
    [(param, fields)] = asked.items()
    try:
        spec = StructuredOutputs.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise BadRequestError(f"{param}: {where + ': ' if where else ''}{err.get('msg')}",
                              param=param) from e
    check_structured_outputs(spec, param, prompts)
    return spec


def _asked(req: StructuredFields) -> dict[str, dict[str, Any]]:
    """Each constraint field the request sets, as `StructuredOutputs` fields."""
    asked: dict[str, dict[str, Any]] = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked["response_format"] = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise BadRequestError("response_format json_schema needs json_schema.schema",
                                  param="response_format")
        asked["response_format"] = {"json": fmt.json_schema.json_schema}
    if req.structured_outputs is not None:
        asked["structured_outputs"] = req.structured_outputs
    guided = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "grammar"}
    for name, kind in guided.items():
        if getattr(req, name) is not None:
            asked[name] = {kind: getattr(req, name)}
    return asked


def check_structured_outputs(spec: StructuredOutputs, param: str, prompts: Prompts) -> None:
    """400 for a constraint that cannot be compiled: a JSON schema that is not JSON, not an
    object or not a valid schema; a regex that does not compile; an empty choice or grammar;
    then the grammar engine's own verdict (it compiles the spec for `prompts.tokenizer`)."""
    try:
        if spec.json_schema is not None:
            schema = json.loads(spec.json_schema)
            if not isinstance(schema, dict):
                raise ValueError("the JSON schema must be an object")
            jsonschema.validators.validator_for(schema).check_schema(schema)
        if spec.regex is not None:
            re.compile(spec.regex)
        if spec.choice is not None and not spec.choice:
            raise ValueError("choice needs at least one string")
        if spec.grammar is not None and not spec.grammar.strip():
            raise ValueError("the grammar is empty")
        engine_check(spec, prompts.tokenizer)
    except jsonschema.SchemaError as e:
        raise BadRequestError(f"{param}: invalid JSON schema: {e.message}", param=param) from e
    except (ValueError, re.error) as e:
        raise BadRequestError(f"{param}: {e}", param=param) from e


def _allowed(ids: list[int], vocab_size: int) -> tuple[int, ...]:
    if not ids:
        raise BadRequestError("allowed_token_ids is empty", param="allowed_token_ids")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise BadRequestError(f"allowed_token_ids holds ids outside the vocabulary "
                              f"[0, {vocab_size}): {bad[:8]}", param="allowed_token_ids")
    return tuple(ids)
