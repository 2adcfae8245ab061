"""The answer's text piece by piece (services/gateway/tokens/detokenizer.py) on the tiny model's real byte-level
tokenizer: the pieces a stream sends always add up to the text the whole answer and the record use, characters split
across tokens are held back until complete, invalid bytes and special tokens come out the same whichever way. Each
check runs every way the detokenizer steps: on the byte table (a byte-level GatewayTokenizer), in the tokenizers
library's DecodeStream (a real tokenizer without a table) and in the Python window (a tokenizer that only decodes)."""

from __future__ import annotations

import random

import pytest
from kvshuttle.services.gateway.tokens import detokenizer
from kvshuttle.services.gateway.tokens.detokenizer import REPLACEMENT, IncrementalText
from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer


class DecodeOnly:
    """A tokenizer with ``decode`` alone: the detokenizer steps in its Python window."""

    def __init__(self, tok: GatewayTokenizer):
        self.decode = tok.decode


@pytest.fixture(scope="module")
def real(model_dir) -> GatewayTokenizer:
    return GatewayTokenizer(model_dir)


class NoTable(GatewayTokenizer):
    """A real tokenizer without the byte table: the detokenizer steps in DecodeStream."""

    def byte_table(self, skip_special_tokens=True):
        return None


def no_table(real: GatewayTokenizer) -> NoTable:
    tok = NoTable.__new__(NoTable)
    tok.__dict__.update(real.__dict__)
    return tok


@pytest.fixture(params=["byte_table", "decode_stream", "window"])
def tok(request, real):
    """The tokenizer the detokenizer gets (``decode``/``encode``/``token_id`` of the real one every way)."""
    if request.param == "byte_table":
        assert real.byte_table() is not None
        return real
    if request.param == "decode_stream":
        return no_table(real)
    wrapped = DecodeOnly(real)
    wrapped.encode, wrapped.token_id = real.encode, real.token_id
    return wrapped


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


def test_a_long_answer_costs_about_one_decode_per_token(real):
    """The per-token path (issue #36): the window's earlier text is the previous step's, so a token costs one
    decode, plus one each time the window moves up (every few tokens), not two."""
    calls = 0

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            nonlocal calls
            calls += 1
            return real.decode(ids, skip_special_tokens)

    text = " ".join(TEXTS * 20)
    ids = real.encode(text)
    out, detok = pieces(Counting(), ids)
    assert "".join(out) == detok.text == text
    assert calls <= 1.2 * len(ids) + 2, (calls, len(ids))


@pytest.mark.parametrize("table", [True, False])
def test_a_real_tokenizer_steps_off_the_window_and_every_way_sends_the_same_pieces(real, table):
    """The byte table, the stream and the window send the same piece for every step, on text and on random ids
    (invalid bytes, special tokens, cut characters); with a real tokenizer only ``finish`` decodes from Python, and
    with its byte table nothing does."""
    rnd = random.Random(3)
    cases = [real.encode(t) for t in TEXTS]
    cases += [[rnd.randrange(real.vocab_size) for _ in range(rnd.randint(1, 30))] for _ in range(200)]
    calls = 0

    class Counting(GatewayTokenizer if table else NoTable):
        def decode(self, ids, skip_special_tokens=True):
            nonlocal calls
            calls += 1
            return super().decode(ids, skip_special_tokens)

    counting = Counting.__new__(Counting)
    counting.__dict__.update(real.__dict__)
    for ids in cases:
        for skip in (True, False):
            for step in (1, 3):
                calls = 0
                streamed, detok = pieces(counting, ids, skip, step)
                assert (detok._table is not None) is table
                assert calls <= (0 if table else 2)  # finish's window only, without the table
                windowed, _ = pieces(DecodeOnly(real), ids, skip, step)
                assert streamed == windowed, ids


def test_a_step_decode_stream_refuses_goes_on_in_the_window(real, monkeypatch):
    """A DecodeStream step that raises (e.g. its new text does not extend the last) leaves the stream: the window
    takes over where the sent text ends, and the pieces still add up to the whole text."""

    original = detokenizer.DecodeStream

    class Refusing:
        def __init__(self, skip_special_tokens):
            self.inner, self.steps = original(skip_special_tokens=skip_special_tokens), 0

        def step(self, tokenizer, ids):
            self.steps += 1
            if self.steps == 4:
                raise Exception("Invalid prefix encountered")
            return self.inner.step(tokenizer, ids)

    monkeypatch.setattr(detokenizer, "DecodeStream", Refusing)
    text = TEXTS[1]
    ids = real.encode(text)
    out, detok = pieces(no_table(real), ids)
    assert detok._stream is None
    assert "".join(out) == detok.text == text
    assert not any(REPLACEMENT in p for p in out)
