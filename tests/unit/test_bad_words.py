"""`bad_words` (vLLM's): the words' token sequences (as written and after a space), the tokens
held back after an output, and the engine's greedy output on SmolLM2 (CPU) with them: the same
tokens up to where a word would end, never a word's sequence, also when speculative decoding's
verify steps sample several positions a sequence."""

from __future__ import annotations

from workers import LLM, SamplingParams
from workers.sampling.bad_words import bad_word_ids, banned_after

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = ["The capital of France is", "My favourite fruit is the"]


def test_a_word_is_its_tokens_as_written_and_after_a_space() -> None:
    tok = LLM(num_kv_pages=8).tokenizer
    bare = tuple(tok.encode("Paris", add_special_tokens=False))
    spaced = tuple(tok.encode(" Paris", add_special_tokens=False))
    assert bare != spaced and bad_word_ids(tok, ["Paris", "  Paris"]) == (bare, spaced) * 2
    assert bad_word_ids(tok, [""]) == ()


def test_a_words_last_token_is_held_back_where_its_others_end_the_output() -> None:
    seqs = ((5,), (7, 8), (1, 2, 3))
    assert banned_after(seqs, ()) == [5]
    assert banned_after(seqs, (9, 7)) == [5, 8]
    assert banned_after(seqs, (1, 2)) == [5, 3]
    assert banned_after(seqs, (2, 1, 2, 9)) == [5]


def _contains(ids: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(ids[i : i + len(seq)]) == seq for i in range(len(ids) - len(seq) + 1))


def test_greedy_output_avoids_the_words_and_keeps_what_comes_before() -> None:
    llm = LLM(num_kv_pages=64)
    tok = llm.tokenizer
    base = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    # a one-token word the first answer holds, and a two-token one the second holds
    single = tok.decode(base[0][:1]).strip()
    k, double = next(
        (k, w) for k in range(len(base[1]) - 1)
        if (w := tok.decode(base[1][k : k + 2])) and bad_word_ids(tok, [w])
        and all(len(s) == 2 for s in bad_word_ids(tok, [w]))
        and tuple(base[1][k : k + 2]) in bad_word_ids(tok, [w])
    )  # fmt: skip
    params = GREEDY.model_copy(update={"bad_words": (single, double)})
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    seqs = bad_word_ids(tok, [single, double])
    assert not any(_contains(ids, s) for ids in got for s in seqs)
    assert got[0][0] != base[0][0]
    assert got[1][: k + 1] == base[1][: k + 1] and got[1][k + 1] != base[1][k + 1]
    spec = LLM(num_kv_pages=64, speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == got
