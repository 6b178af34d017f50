"""The streamed text of an output, token by token (model/tokenizer.py IncrementalDecoder), on
the bundled model's tokenizer: the same text as decoding the whole output at each token, for a
window's cost."""

import random

import pytest

from pdserve.model.loader import load_tokenizer
from pdserve.model.tokenizer import IncrementalDecoder


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def whole_output_deltas(tok, ids: list[int]) -> list[str]:
    """The reference: the whole output decoded at every token, its new text released unless
    it ends in an incomplete character."""
    emitted, deltas = "", []
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        if text.endswith("\ufffd"):
            deltas.append("")
            continue
        deltas.append(text[len(emitted) :])
        emitted = text
    return deltas


def test_multibyte_text_streams_whole_characters(tok):
    text = "Héllo wörld — 日本語のテキスト 🙂 👩\u200d👩\u200d👧 ‘quoted’ … ✓\n\tdef f(x): return x"
    ids = tok.encode(text)
    decoder = IncrementalDecoder(tok)
    deltas = [decoder.push(i) for i in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some character spans tokens: held back until complete


def test_any_token_sequence_gives_the_whole_output_decodes_deltas(tok):
    rng = random.Random(0)
    pool = tok.encode("日本語 🙂 é ü 中文 ✓ the cat") + [0, 1, 2]  # byte tokens and specials
    for _ in range(200):
        ids = [
            rng.choice(pool) if rng.random() < 0.6 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randrange(1, 60))
        ]
        decoder = IncrementalDecoder(tok)
        assert [decoder.push(i) for i in ids] == whole_output_deltas(tok, ids)


def test_a_tokens_cost_does_not_grow_with_the_output(tok):
    decoded = []

    class Counting:
        def decode(self, ids):
            decoded.append(len(ids))
            return tok.decode(ids)

    decoder = IncrementalDecoder(Counting())
    ids = tok.encode(" word" * 1000)
    text = "".join(decoder.push(i) for i in ids)
    assert text == tok.decode(ids)
    assert max(decoded) <= 4  # a window of a few tokens, not the 1,000 so far
