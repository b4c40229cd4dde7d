"""The request fields that constrain an output, as OpenAI and vLLM name them (typed here, mapped
to the engine's `StructuredOutputs` by `router.structured`):

    response_format       {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    structured_outputs    vLLM's object: exactly one of json, regex, choice, grammar, json_object
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older fields
    allowed_token_ids     only these tokens may be sampled
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(BaseModel):
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[int] | None = None
