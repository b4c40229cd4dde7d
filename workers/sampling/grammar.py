"""Structured outputs to grammars, through llguidance (docs/notes/structured-outputs.md says why
this engine): a `StructuredOutputs` spec is compiled into matchers in their start state, a few
per spec and tokenizer (shards); each request gets a copy of one of them (`Constraint`,
workers/sampling/constraint.py).

Compilation runs on a small thread pool (llguidance drops the GIL while it builds a grammar),
off the engine loop; a bad spec is a `ValueError` naming the problem.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf

from workers.protocol import StructuredOutputs

COMPILE_THREADS = 2
CACHE_SIZE = 256  # compiled specs kept (least recently used dropped)
# Compact JSON with one space after ',' and ':': a small model cannot loop on whitespace.
JSON_OPTIONS: Any = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def grammar_text(spec: StructuredOutputs) -> str:
    """`spec` as an llguidance grammar (JSON text); ValueError if it is malformed."""
    if spec.json_schema is not None:
        return _json_grammar(spec.json_schema)
    if spec.json_object:
        return _json_grammar('{"type": "object"}')
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        if not spec.choice:
            raise ValueError("choice needs at least one string")
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
    if spec.grammar is not None:
        return llguidance.grammar_from("grammar", spec.grammar)  # GBNF or Lark
    assert spec.structural_tag is not None
    return _structural_tag_grammar(spec.structural_tag)


def _json_grammar(schema: str) -> str:
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"json schema is not valid JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise ValueError("json schema must be an object")
    return llguidance.LLMatcher.grammar_from_json_schema(parsed, defaults=JSON_OPTIONS)


def _structural_tag_grammar(text: str) -> str:
    """vLLM's structural tag, `{"structures": [{"begin", "schema", "end"}], "triggers": [..]}`:
    free text in which a trigger starts one of the structures, whose body is JSON of its schema."""
    try:
        tag = json.loads(text)
        triggers, structures = list(tag["triggers"]), list(tag["structures"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"structural_tag needs 'triggers' and 'structures': {e}") from e
    tags = []
    for s in structures:
        begin = s.get("begin", "") if isinstance(s, dict) else ""
        trigger = next((t for t in triggers if t and begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structural_tag: no trigger starts the structure begin {begin!r}")
        tags.append(
            llguidance.StructTag(
                trigger=trigger, begin=begin, grammar=s.get("schema", {}), end=s.get("end", "")
            )
        )
    if not tags:
        raise ValueError("structural_tag has no structures")
    return llguidance.StructTag.to_grammar(tags)


def vocab_tokenizer(hf_tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of `hf_tokenizer` over `vocab_size` logits (ids past the tokenizer's
    own are never allowed). Slow (about a second): built once per engine."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)


def compile_matcher(spec: StructuredOutputs, tokenizer: llguidance.LLTokenizer) -> Any:
    """A matcher of `spec` in its start state; ValueError naming what is wrong with `spec`."""
    try:
        text = grammar_text(spec)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - llguidance's own conversion errors
        raise ValueError(f"invalid structured output: {e}") from e
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
    if matcher.is_error():
        raise ValueError(f"invalid structured output: {matcher.get_error()}")
    return matcher


def check_structured_outputs(spec: StructuredOutputs, tokenizer: Any) -> None:
    """Raise ValueError naming the problem if `spec` cannot be compiled, so the API answers 400
    before it queues the request. `tokenizer`: the model's Hugging Face tokenizer (its
    llguidance view is built once per tokenizer, about a second) or an `LLTokenizer`."""
    if not isinstance(tokenizer, llguidance.LLTokenizer):
        with _views_lock:
            view = _views.get(tokenizer)
            if view is None:
                view = _views[tokenizer] = vocab_tokenizer(tokenizer, len(tokenizer))
        tokenizer = view
    compile_matcher(spec, tokenizer)


_views: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_views_lock = threading.Lock()


@dataclass
class _Shards:
    futures: list[Future[Any]] = field(default_factory=list)
    turn: int = 0  # requests of the spec so far: the next takes shard turn % shards


class GrammarCompiler:
    """Compiles specs on a thread pool, each into up to `shards` matchers that requests of the
    spec take in turn (the futures are cached; once a spec is known to fail, its requests get
    that failure and nothing compiles again). Copies of one matcher share its lexer, and the
    lexer states it has built, behind a lock: the masks of a step's requests fill in parallel
    only across shards (`MaskFiller`). `make_tokenizer` runs once, on the pool too:
    llguidance's tokenizer takes about a second."""

    def __init__(
        self,
        make_tokenizer: Callable[[], llguidance.LLTokenizer],
        shards: int = 1,
        threads: int = COMPILE_THREADS,
    ) -> None:
        self._make_tokenizer = make_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._shards = shards
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[StructuredOutputs, _Shards] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, spec: StructuredOutputs) -> Future[Any]:
        """A future of a start-state matcher of `spec` (shared: copy it before use)."""
        with self._lock:
            entry = self._cache.get(spec)
            if entry is None:
                entry = self._cache[spec] = _Shards()
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
            futures, k = entry.futures, entry.turn % self._shards
            entry.turn += 1
            if futures and futures[0].done() and futures[0].exception() is not None:
                return futures[0]  # invalid: no other shard would compile either
            if k == len(futures):
                futures.append(self._pool.submit(self._compile, spec))
            return futures[k]

    def _compile(self, spec: StructuredOutputs) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
        return compile_matcher(spec, self._tokenizer)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
