"""docs/api-compatibility.md held to the code: every request field of the models has a row,
every row names a field the code knows, the refused fields are exactly `router.params`' list,
nothing the models take is "planned", and every response field is listed."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from router.params import UNSUPPORTED_EXTRAS
from router.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    TokenizeRequest,
)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "api-compatibility.md"
# extra fields `router.params.check_supported` reads besides UNSUPPORTED_EXTRAS
CHECKED_EXTRAS = {"best_of"}
# vLLM's /tokenize fields that pdserve's TokenizeRequest keeps as extras (ignored)
TOKENIZE_EXTRAS = {"chat_template", "mm_processor_kwargs"}


def rows(section: str) -> dict[str, set[str]]:
    """Field name (as in the first column's backticks, its root: `a.b` and `a[].b` are `a`)
    -> the statuses of its rows (a field may have one per endpoint), in the table under
    `## <section>`."""
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    out: dict[str, set[str]] = {}
    for line in text[start : end if end > 0 else None].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not line.startswith("| `"):
            continue
        for name in re.findall(r"`([^`]+)`", cells[0]):
            out.setdefault(re.split(r"[.\[]", name)[0], set()).add(cells[1])
    return out


def fields(*models: type[BaseModel]) -> set[str]:
    return {name for m in models for name in m.model_fields}


def test_every_request_field_has_a_row_and_every_row_a_field() -> None:
    table = rows("Request fields (completions and chat)")
    known = fields(CompletionRequest, ChatCompletionRequest)
    assert known - table.keys() == set(), "fields of the request models without a row"
    assert table.keys() - known - set(UNSUPPORTED_EXTRAS) - CHECKED_EXTRAS == set(), \
        "rows that name no field the router reads"


def test_refused_fields_are_router_params_list() -> None:
    table = rows("Request fields (completions and chat)")
    refused = {name for name, statuses in table.items() if any("refused" in s for s in statuses)}
    assert refused == set(UNSUPPORTED_EXTRAS) | CHECKED_EXTRAS
    for name in fields(CompletionRequest, ChatCompletionRequest):  # taken by some endpoint
        assert table[name] & {"supported", "ignored", "supported for `text` parts"}, name
        assert not any("planned" in s for s in table[name]), name


def test_tokenize_rows_match_the_models() -> None:
    table = rows("/tokenize and /detokenize fields")
    known = fields(TokenizeRequest, DetokenizeRequest)
    assert known - table.keys() == set()
    assert table.keys() - known == TOKENIZE_EXTRAS
    assert all(table[n] == {"ignored"} for n in TOKENIZE_EXTRAS)
    assert all(table[n] == {"supported"} for n in known)


def test_every_response_field_has_a_row() -> None:
    table = rows("Response fields")
    models = (ChatCompletionResponse, CompletionResponse, ChatCompletionChunk, CompletionChunk)
    assert fields(*models) - table.keys() == set()
