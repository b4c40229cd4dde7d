"""A GGUF vocabulary converted with the wrong decoder gets its byte-level one back."""

from __future__ import annotations

from pathlib import Path

from tokenizers import decoders

from workers.model.files import byte_level_decoder, load_tokenizer
from workers.sampling.grammar import vocab_tokenizer


def test_a_byte_level_vocabulary_gets_a_byte_level_decoder(smollm2_dir: Path) -> None:
    tok = load_tokenizer(smollm2_dir)
    space = tok.encode(" ", add_special_tokens=False)
    # what transformers 5.17 loads for SmolLM2's converted GGUF vocabulary
    tok.backend_tokenizer.decoder = decoders.Sequence([
        decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("▁", " "),
        decoders.ByteLevel(add_prefix_space=True),
    ])  # fmt: skip
    assert vocab_tokenizer(tok, len(tok)).decode_bytes(space) != b" "
    byte_level_decoder(tok)
    assert tok.decode(space) == " "
    assert vocab_tokenizer(tok, len(tok)).decode_bytes(space) == b" "
    byte_level_decoder(tok)  # a right decoder stays as it is
    assert tok.decode(tok.encode("Hi there", add_special_tokens=False)) == "Hi there"
