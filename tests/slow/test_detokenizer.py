"""The answer's text piece by piece (services/gateway/tokens/detokenizer.py) on the tiny model's real byte-level
tokenizer: the pieces a stream sends always add up to the text the whole answer and the record use, characters split
across tokens are held back until complete, invalid bytes and special tokens come out the same whichever way."""

from __future__ import annotations

import pytest
from kvshuttle.services.gateway.tokens.detokenizer import REPLACEMENT, IncrementalText
from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer


@pytest.fixture(scope="module")
def tok(model_dir) -> GatewayTokenizer:
    return GatewayTokenizer(model_dir)


def pieces(tok, ids, skip=True, step=1) -> tuple[list[str], IncrementalText]:
    detok = IncrementalText(tok, skip)
    out = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    out.append(detok.finish())
    return out, detok


TEXTS = ["plain ascii text", "Grüße aus Köln — 日本語 🚀🧪 👨‍👩‍👧 e\u0301", "def f(x):\n    return x * 2\n"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_pieces_add_up_to_the_whole_text(tok, text, step):
    ids = tok.encode(text)
    out, detok = pieces(tok, ids, step=step)
    assert "".join(out) == detok.text == tok.decode(ids) == text
    assert not any(REPLACEMENT in p for p in out)  # a split character waits for its last byte


def test_invalid_bytes_and_a_cut_character_come_out_the_same_whichever_way(tok):
    emoji = tok.encode("🚀")
    assert len(emoji) > 1  # byte-level: one character, several tokens
    ids = [*tok.encode("a "), *emoji[:-1], *tok.encode(" b"), *emoji[:-1]]  # a broken character, then a cut one
    out, detok = pieces(tok, ids)
    assert "".join(out) == detok.text == tok.decode(ids) and detok.text.count(REPLACEMENT) >= 2


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tok, skip):
    ids = [*tok.encode("one "), tok.token_id("<|endoftext|>"), *tok.encode(" two")]
    out, detok = pieces(tok, ids, skip=skip)
    assert "".join(out) == detok.text == tok.decode(ids, skip)
    assert ("<|endoftext|>" in detok.text) is not skip


def test_a_long_answer_costs_about_one_decode_per_token(tok):
    """The per-token path (issue #36): the window's earlier text is the previous step's, so a token costs one
    decode, plus one each time the window moves up (every few tokens), not two."""
    calls = 0

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            nonlocal calls
            calls += 1
            return tok.decode(ids, skip_special_tokens)

    text = " ".join(TEXTS * 20)
    ids = tok.encode(text)
    out, detok = pieces(Counting(), ids)
    assert "".join(out) == detok.text == text
    assert calls <= 1.2 * len(ids) + 2, (calls, len(ids))
