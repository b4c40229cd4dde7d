"""OpenAI request fields into the engine's `SamplingParams`, refusing what we cannot honour.

A field that would change the output but that the engine does not implement is answered with 400
"not supported" rather than ignored: beam search, `tools` on completions. Unknown fields that do
not change the output are ignored. Constraints (response_format, guided_*, tools) are mapped by
`router.structured` and passed in as `constraints`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from router.errors import BadRequestError, error_text
from router.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from workers.api import SamplingParams

logger = logging.getLogger(__name__)

# Omitted, these take the model's generation_config.json values (as vLLM does), else ours.
SAMPLING_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
PASSED_IF_SET = ("presence_penalty", "frequency_penalty", "logit_bias")

# Unknown (extra) fields that change the output unless they hold their neutral value.
UNSUPPORTED_EXTRAS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "logits_processors": (None, []),
    "tools": (None, []),
    "functions": (None, []),
}
NO_BEAMS = "no beam search: each choice is sampled on its own"
WHY_UNSUPPORTED = {"use_beam_search": NO_BEAMS, "length_penalty": NO_BEAMS}


def generation_defaults(model_dir: Path) -> dict[str, float]:
    """The sampling defaults a model's generation_config.json sets (of SAMPLING_DEFAULTABLE)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {
        name: float(config[name])
        for name in SAMPLING_DEFAULTABLE
        if isinstance(config.get(name), int | float) and not isinstance(config[name], bool)
    }


def check_supported(req: SamplingFields) -> None:
    """400 for a field that would change the output in a way the engine cannot."""
    extra = req.model_extra or {}
    for name, allowed in UNSUPPORTED_EXTRAS.items():
        if name in extra and not any(extra[name] == v for v in allowed):
            why = f" ({WHY_UNSUPPORTED[name]})" if name in WHY_UNSUPPORTED else ""
            raise BadRequestError(f"{name} is not supported{why}", param=name)
    best_of = extra.get("best_of")
    if best_of is not None and (not isinstance(best_of, int) or isinstance(best_of, bool)
                                or best_of < req.n):
        raise BadRequestError(f"best_of must be an integer of at least n ({req.n})",
                              param="best_of")
    if best_of is not None and best_of > req.n:  # as vLLM's V1 engine: no ranking of choices
        raise BadRequestError("best_of greater than n is not supported", param="best_of")
    if req.prompt_logprobs is not None and req.stream:
        raise BadRequestError("prompt_logprobs is not supported with stream",
                              param="prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise BadRequestError("stream_options is only allowed when stream is true",
                              param="stream_options")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        raise BadRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    ignored = sorted(set(extra) - set(UNSUPPORTED_EXTRAS))
    if ignored:
        logger.debug("request fields ignored: %s", ", ".join(ignored))


def requested_logprobs(req: SamplingFields) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    assert isinstance(req, CompletionRequest)
    return req.logprobs


def wanted_prompt_logprobs(req: SamplingFields) -> int | None:
    """Top-N for the prompt's tokens: vLLM's `prompt_logprobs`, or completions with echo and
    logprobs (whose echoed prompt carries logprobs too); the larger where both ask."""
    echoed = req.logprobs if isinstance(req, CompletionRequest) and req.echo else None
    asked = [n for n in (req.prompt_logprobs, echoed) if n is not None]
    return max(asked) if asked else None


def sampling_params(req: SamplingFields, max_tokens: int, seed_offset: int = 0,
                    defaults: Mapping[str, float] | None = None,
                    constraints: Mapping[str, Any] | None = None) -> SamplingParams:
    """The engine's parameters for one choice; `seed_offset` makes n seeded choices differ.

    `defaults` stands in for omitted SAMPLING_DEFAULTABLE fields, as vLLM takes them from the
    model's generation_config.json (`generation_defaults`); `constraints` are the fields
    `router.structured.constraint_params` made of the request's constraints.
    """
    if req.min_tokens > max_tokens:
        raise BadRequestError(f"min_tokens ({req.min_tokens}) must not exceed max_tokens "
                              f"({max_tokens})", param="min_tokens")
    fields: dict[str, Any] = dict(defaults or {})
    for name in (*SAMPLING_DEFAULTABLE, *PASSED_IF_SET):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    fields |= {
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "seed": None if req.seed is None else req.seed + seed_offset,
        "stop": req.stop,
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "logprobs": requested_logprobs(req),
        "prompt_logprobs": wanted_prompt_logprobs(req),
        "skip_special_tokens": req.skip_special_tokens,
        "bad_words": tuple(req.bad_words or ()),
        **(constraints or {}),
    }
    try:
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        raise BadRequestError(f"{param}: {error_text(err)}", param=param) from e
