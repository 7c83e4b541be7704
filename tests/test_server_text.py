"""Incremental detokenization and stop strings, on a small byte-level BPE tokenizer
(multi-byte characters split over tokens, as in SmolLM2's)."""

from __future__ import annotations

import random

import pytest
from server_fixtures import byte_level_tokenizer

from eaglesrv.server.detokenizer import IncrementalDetokenizer
from eaglesrv.server.stop_strings import StopStringFilter


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


SAMPLES = ["The capital of France is Paris.", "日本語 and 🦅 mixed with naïve café", "🦅🦅🦅"]


@pytest.mark.parametrize("text", SAMPLES)
def test_one_token_at_a_time_gives_whole_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters really are split over tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Q: "))
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in d for d in deltas)


def test_random_token_soup_joins_to_the_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 25))]
        detok = IncrementalDetokenizer(tokenizer)
        pieces, i = [], 0
        while i < len(ids):  # arrive in groups of 1-3, as with speculative decoding
            step = rng.randrange(1, 4)
            pieces.append(detok.add(ids[i : i + step]))
            i += step
        joined = "".join(pieces) + detok.flush()
        assert joined == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hello") + [tokenizer.eos_token_id]
    skipping = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    keeping = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(skipping.add([i]) for i in ids) == "hello"
    assert "".join(keeping.add([i]) for i in ids) == "hello<eos>"


def _feed_all(stops, pieces):
    filt = StopStringFilter(stops)
    out, matched = [], None
    for n, piece in enumerate(pieces):
        text, matched = filt.feed(piece, final=n == len(pieces) - 1)
        out.append(text)
        if matched:
            break
    return out, matched


@pytest.mark.parametrize("stops,pieces,released,matched", [
    (["\nUser:"], ["Hi", "\nUs", "er: x"], ["Hi", "", ""], "\nUser:"),
    (["\nUser:"], ["Hi", "\nUs", "ually"], ["Hi", "", "\nUsually"], None),
    (["Paris"], ["The capital is Pa", "ris."], ["The capital is ", ""], "Paris"),
    (["ab", "b"], ["xa", "b"], ["x", ""], "ab"),  # the earliest match wins
    (["."], ["one. two."], ["one"], "."),
    ([], ["anything"], ["anything"], None),
    (["stop"], ["no match, and st"], ["no match, and st"], None),  # final piece: nothing held back
])
def test_stop_strings(stops, pieces, released, matched):
    out, hit = _feed_all(stops, pieces)
    assert out == released and hit == matched
    for stop in stops:
        assert stop not in "".join(out)


def test_stop_string_never_leaks_over_random_splits():
    rng = random.Random(1)
    text = "Answer: 42\n\nUser: next question\nUser: again"
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        out, hit = _feed_all(["\nUser:"], pieces)
        assert "".join(out) == "Answer: 42\n" and hit == "\nUser:"
        assert all("\nU" not in p for p in out)


def test_the_held_back_tail_is_the_longest_proper_prefix_of_a_stop_string():
    def brute_force(stops, text):  # the definition, one length at a time
        return max([size for stop in stops for size in range(1, min(len(stop) - 1, len(text)) + 1)
                    if text.endswith(stop[:size])], default=0)

    rng = random.Random(7)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 9)))
        assert StopStringFilter(stops)._partial_match_len(text) == brute_force(stops, text), (stops, text)
