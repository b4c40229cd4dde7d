"""Incremental detokenisation: never a split UTF-8 character, stop strings never leak."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.detokenizer import IncrementalDetokenizer
from workers.model.files import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):  # noqa: ANN201
    return load_tokenizer(smollm2_dir)


def stream(tokenizer, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], str | None]:  # noqa: ANN001
    prompt = tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=stop)
    chunks, matched = [], None
    for token in tokenizer.encode(text):
        matched = detok.add_token(token)
        chunks.append(detok.take_new_text(finished=matched is not None))
        if matched:
            break
    chunks.append(detok.take_new_text(finished=True))
    return chunks, matched


def test_multibyte_characters_are_never_split(tokenizer) -> None:
    text = " Grüße 🙂🚀 日本語 — ok"
    tokens = tokenizer.encode(text)
    assert len(tokens) > len(text.split())  # some characters span several byte tokens
    chunks, _ = stream(tokenizer, text)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tokenizer.decode(tokens)


def test_stop_string_is_cut_and_never_streamed_early(tokenizer) -> None:
    chunks, matched = stream(tokenizer, " one two three STOP four", stop=("STOP",))
    assert matched == "STOP"
    assert "".join(chunks) == " one two three "
    assert all("ST" not in c for c in chunks)


@pytest.mark.parametrize("cut", [1, 2, 5, 6])
def test_an_output_cut_inside_a_character_ends_in_a_replacement_char(tokenizer, cut) -> None:
    """Finished inside a character (max_tokens), the text is the token ids decoded, U+FFFD for
    the partial bytes, as vLLM's; while running those bytes wait for the rest."""
    tokens = tokenizer.encode(" 日本語")[:cut]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    running = []
    for token in tokens:
        detok.add_token(token)
        running.append(detok.take_new_text(finished=False))
    assert "\ufffd" not in "".join(running)
    ended = "".join(running) + detok.take_new_text(finished=True)
    assert ended == tokenizer.decode(tokens) and ended.endswith("\ufffd")
    assert detok.take_new_text(finished=True) == ""  # flushed once
