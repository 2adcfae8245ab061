"""A byte-level tokenizer's table of each id's bytes (tokens/byte_pieces.py) and the detokenizer's steps on it
(tokens/detokenizer.py): any ids, one or several per step, special tokens skipped or kept, give the pieces the Python
window gives and, joined, the tokenizer's own decode; a tokenizer whose decoder is not byte-level alone, or that
decodes an id otherwise than the table would, gets no table. On a byte-level BPE trained in the test (Qwen's kind)
with an added token outside the byte map."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvshuttle.services.gateway.tokens.byte_pieces import CHAR_BYTES, byte_tables, token_bytes
from kvshuttle.services.gateway.tokens.detokenizer import REPLACEMENT, IncrementalText
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = ["Plain text, code: def f(x): return x * 2", "Ünïcödé, 中文, emoji 🙂🚀, e\u0301", "<think> a </think>"] * 8
SPECIAL = ["<|endoftext|>", "<|im_end|>", "<｜end▁of▁sentence｜>"]  # the last one's characters are outside the map


def trained(decoder=None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoder or decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    return tok


TOK = trained()


class Backed:
    """What the detokenizer reads of a GatewayTokenizer: the table, or (``table=False``) only ``decode``."""

    def __init__(self, tok: Tokenizer, table: bool = True):
        self.tables = byte_tables(tok) if table else None
        self._tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def byte_table(self, skip_special_tokens=True):
        return self.tables[skip_special_tokens] if self.tables is not None else None


def steps(tok, ids, skip, step):
    detok = IncrementalText(tok, skip)
    out = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    return [*out, detok.finish()], detok


def test_the_byte_map_is_gpt2_s_and_a_token_outside_it_is_its_own_utf8():
    assert len(CHAR_BYTES) == 256 and sorted(CHAR_BYTES.values()) == list(range(256))
    assert CHAR_BYTES["Ġ"] == 0x20 and CHAR_BYTES["!"] == ord("!")
    assert token_bytes("Ġhi") == b" hi" and token_bytes("<｜end▁of▁sentence｜>") == "<｜end▁of▁sentence｜>".encode()


def test_a_trained_byte_level_tokenizer_gets_tables_that_skip_special_tokens_or_keep_them():
    tables = byte_tables(TOK)
    assert tables is not None
    end = TOK.token_to_id("<|im_end|>")
    assert tables[False][end] == b"<|im_end|>" and tables[True][end] == b""
    think = TOK.token_to_id("<think>")
    assert tables[True][think] == tables[False][think] == b"<think>"  # an added token that is not special stays


@given(st.lists(st.integers(0, TOK.get_vocab_size(with_added_tokens=True) + 3), max_size=40),
       st.booleans(), st.integers(1, 3))
@settings(max_examples=300, deadline=None)
def test_table_steps_send_the_window_s_pieces_and_add_up_to_the_tokenizer_s_decode(ids, skip, step):
    table, window = Backed(TOK), Backed(TOK, table=False)
    got, detok = steps(table, ids, skip, step)
    assert detok._table is not None
    assert got == steps(window, ids, skip, step)[0]  # the same pieces, held back alike
    assert "".join(got) == detok.text == TOK.decode(ids, skip_special_tokens=skip)


def test_a_character_split_over_tokens_waits_for_its_last_byte():
    ids = TOK.encode("a 🚀 b").ids
    got, _ = steps(Backed(TOK), ids, True, 1)
    assert "".join(got) == "a 🚀 b" and REPLACEMENT not in "".join(got)
    assert len([p for p in got if p]) < len(ids)  # some steps sent nothing: the character was not finished


def test_no_table_for_a_decoder_that_is_not_byte_level_alone():
    assert byte_tables(trained(decoders.Sequence([decoders.ByteLevel()]))) is None
    assert byte_tables(trained(decoders.Metaspace())) is None


def test_no_table_when_an_id_would_decode_otherwise(monkeypatch):
    """The table is checked against the tokenizer's decode of every id: one that differs leaves it off."""
    from kvshuttle.services.gateway.tokens import byte_pieces
    real = byte_pieces.token_bytes
    monkeypatch.setattr(byte_pieces, "token_bytes", lambda token: b"x" if token == "<think>" else real(token))
    assert byte_tables(TOK) is None


@pytest.mark.parametrize("skip", [True, False])
def test_invalid_bytes_come_out_as_the_tokenizer_writes_them(skip):
    """Single bytes that are no UTF-8 on their own (a lone continuation byte, a cut lead byte) between text."""
    byte_ids = [TOK.token_to_id(c) for c, b in CHAR_BYTES.items() if b >= 0x80 and TOK.token_to_id(c) is not None]
    ids = [*TOK.encode("ok ").ids, *byte_ids[:6], *TOK.encode(" then").ids, byte_ids[-1]]
    got, detok = steps(Backed(TOK), ids, skip, 1)
    assert "".join(got) == detok.text == TOK.decode(ids, skip_special_tokens=skip)
    assert REPLACEMENT in detok.text
