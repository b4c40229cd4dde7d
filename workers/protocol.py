"""Types that cross the workers' door: requests, sampling parameters, outputs, KV handles.

Pydantic at the boundary (validated once, when a request enters); the hot loops copy what they
need into plain dataclasses (`workers/sequence.py`).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator, model_validator

FinishReason = Literal["stop", "length", "abort", "error"]

MAX_LOGPROBS = 20
_KEEP_A_TOKEN = "truncate_prompt_tokens must be -1 or at least 1"


class StructuredOutputs(BaseModel):
    """A constraint on a request's output, as vLLM's `structured_outputs` names it: exactly one of
    the kinds. The grammar engine compiles it (cached per spec) and masks the logits each step."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    json_schema: str | None = Field(
        None, alias="json", description="a JSON schema, as JSON text (dicts are dumped)"
    )
    json_object: bool = Field(False, description="any JSON object")
    regex: str | None = None
    choice: tuple[str, ...] | None = Field(None, description="one of these strings")
    grammar: str | None = Field(None, description="an EBNF (GBNF or Lark) grammar")
    structural_tag: str | None = Field(
        None, description="free text with tagged JSON sections (tool calls), as JSON text"
    )

    @field_validator("json_schema", "structural_tag", mode="before")
    @classmethod
    def _dump_dict(cls, v: object) -> object:
        return json.dumps(v) if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        named = ("json_schema", "regex", "choice", "grammar", "structural_tag")
        kinds = [k for k in named if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one constraint, got {kinds or 0}")
        return self


class SamplingParams(BaseModel):
    """Per-request sampling and stopping rules, as vLLM names them."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    max_tokens: int = Field(16, ge=1, description="new tokens at most")
    min_tokens: int = Field(
        0, ge=0, description="output tokens before EOS or a stop token / string may end it"
    )
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_k: int = Field(0, ge=-1, description="0 or -1: off")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[NonNegativeInt, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="top-N logprobs per token"
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="top-N logprobs per prompt token (no prefix cache)"
    )
    skip_special_tokens: bool = True
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="off the logits of every token the output holds"
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="off the logits, times each token's count in the output"
    )
    repetition_penalty: float = Field(
        1.0, gt=0.0, description="divides positive, multiplies negative logits of seen tokens"
    )
    logit_bias: tuple[tuple[int, float], ...] = Field(
        (), description="(token id, bias in [-100, 100]) pairs added to the logits"
    )
    allowed_token_ids: tuple[NonNegativeInt, ...] | None = Field(
        None, description="only these tokens may be sampled"
    )
    structured_outputs: StructuredOutputs | None = None
    bad_words: tuple[str, ...] = Field(
        (), description="words the output may not contain (a word's last token is held back "
        "where its others end the output)",
    )  # fmt: skip
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="only the prompt's last k tokens are used; -1: the context's"
    )

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_a_token(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError(_KEEP_A_TOKEN)
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_as_pairs(cls, v: object) -> object:
        """OpenAI's form, a map from token id (a string in JSON) to bias, as sorted pairs."""
        if isinstance(v, dict):
            try:
                return tuple(sorted((int(k), b) for k, b in v.items()))
            except ValueError as e:
                raise ValueError("logit_bias keys must be token ids") from e
        return () if v is None else v

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, v: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        for token, bias in v:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias {token}: {bias} outside [-100, 100] or negative id")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_tuple(cls, v: object) -> object:
        if isinstance(v, str):
            return (v,)
        return () if v is None else v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def truncated_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's `truncate_prompt_tokens`; -1: as many as the
    context holds; None: all of them); ValueError for 0 or more than the context."""
    if keep is None:
        return ids
    if keep == 0:
        raise ValueError(_KEEP_A_TOKEN)
    if keep > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
            f"({max_model_len}). Please select a smaller truncation size."
        )
    return ids[-(max_model_len if keep == -1 else keep) :]


class LoRARequest(BaseModel):
    """A LoRA adapter a request runs with, as vLLM's: its name, an id unique per adapter (> 0;
    the prefix cache and the device slots key by it) and its PEFT directory. `runtime`: loaded
    through POST /v1/load_lora_adapter, so a replica frees it once the app's registry drops it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int = Field(ge=1)
    lora_path: str = Field(min_length=1)
    runtime: bool = False


class GenerateRequest(BaseModel):
    """One prompt, already tokenized, with its sampling rules (and adapter: None, the base)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    lora: LoRARequest | None = None
    cache_salt: str | None = Field(
        None, min_length=1, description="vLLM's: prefix-cache pages shared only within one salt"
    )
    priority: int = Field(
        0, ge=-(2**63), le=2**63 - 1,
        description="vLLM's: lower runs first where the engine's scheduling_policy is 'priority'",
    )  # fmt: skip

    @field_validator("prompt_token_ids")
    @classmethod
    def _non_empty(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v:
            raise ValueError("prompt is empty: at least one token is needed")
        if min(v) < 0:
            raise ValueError("prompt token ids must be non-negative")
        return v


class TokenLogprob(BaseModel):
    token_id: int
    logprob: float
    top: dict[int, float] = {}
    rank: int | None = None  # in its distribution, 1 = the most likely (prompt tokens)


INT8_SCALE_BYTES = 4  # an int8 pool's row ends in its float32 scale (kvcache/int8_rows.py)


class KVLayout(BaseModel):
    """Shape of one KV page on one rank: [num_layers, 2, page_size, num_kv_heads, row_width]."""

    model_config = ConfigDict(frozen=True)

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_head_offset: int = Field(0, description="first global KV head this rank holds")

    @property
    def row_width(self) -> int:
        """Elements of one (token, head) row: head_dim, and an int8 pool's scale after it."""
        return self.head_dim + (INT8_SCALE_BYTES if self.dtype == "int8" else 0)

    @property
    def page_bytes(self) -> int:
        elems = self.num_layers * 2 * self.page_size * self.num_kv_heads * self.row_width
        import torch  # here: the routers use these types and never load torch

        return elems * getattr(torch, self.dtype).itemsize


class KVHandle(BaseModel):
    """Where a prompt's KV pages lie on a prefill replica, one agent per TP rank."""

    model_config = ConfigDict(frozen=True)

    agent_names: list[str]
    page_ids: list[int]
    num_tokens: int
    layout: list[KVLayout]
    lease_id: str
    lease_expiry: float = Field(description="unix time after which the pages may be reused")
    page_generations: list[int] = Field(
        default_factory=list, description="generation of each page when it was pinned"
    )


class RequestOutput(BaseModel):
    """A chunk of a request's stream: the tokens that are new since the last chunk.

    The last chunk of a request has `finish_reason` set; `stop_reason` holds the matched stop
    string or stop token id (None for EOS), as vLLM reports it.
    """

    request_id: str
    token_ids: list[int] = []
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = Field(
        None, description="with the first token: one per prompt token, None for the first"
    )
    error: str | None = None
    kv: KVHandle | None = Field(
        None, description="prefill role: where the prompt's KV waits for the decode worker"
    )
    # speculative decoding: the request's drafted and accepted tokens so far
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_keepalive(self) -> bool:
        """A chunk that says only "this replica's engine runs" (`AsyncEngine.stream`): no token,
        no text, no end, no hand-off."""
        return not (self.token_ids or self.text or self.finished or self.kv is not None)

    def then(self, later: RequestOutput) -> RequestOutput:
        """This chunk and the next one of the same request as one chunk (streams coalesce
        chunks to send fewer messages: `EngineConfig.stream_interval_ms`)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return later.model_copy(
            update=dict(
                token_ids=self.token_ids + later.token_ids,
                text=self.text + later.text,
                logprobs=logprobs,
                num_prompt_tokens=later.num_prompt_tokens or self.num_prompt_tokens,
                prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            )
        )
