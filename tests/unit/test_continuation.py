from dataclasses import dataclass

from kvshuttle.control_plane.continuation import plan_continuation, text_key
from kvshuttle.control_plane.selection import RoundRobin

PREV = "<s>user: hï\nbot: yo"  # what the record knows of it: its length in characters and its key


def cont(prev_text, prev_ids, new_text):
    return plan_continuation(len(prev_text), text_key(prev_text) if prev_text else b"", prev_ids, new_text)


def test_extension_splices_onto_exact_ids():
    c = cont(PREV, [1, 2, 3], PREV + "\nuser: more")
    assert c.continues and c.prefix_ids == (1, 2, 3) and c.suffix_text == "\nuser: more"
    c = cont(PREV, [1, 2, 3], PREV)  # nothing new yet
    assert c.continues and c.suffix_text == ""


def test_edited_history_starts_over():
    c = cont(PREV, [1, 2, 3], "<s>user: HÏ\nbot: yo\nuser: more")
    assert not c.continues and c.suffix_text.startswith("<s>user: HÏ")
    c = cont(PREV, [1, 2, 3], PREV[:-1])  # shorter than the recorded text
    assert not c.continues and c.suffix_text == PREV[:-1]


def test_the_length_and_the_key_must_both_fit():
    new = PREV + "\nuser: more"
    assert not plan_continuation(len(PREV) + 1, text_key(PREV), [1, 2, 3], new).continues
    assert not plan_continuation(len(PREV), text_key(PREV + "!"), [1, 2, 3], new).continues
    assert not plan_continuation(len(PREV), text_key(PREV), [], new).continues  # no ids to splice onto


def test_no_previous_turn():
    assert not plan_continuation(0, b"", [], "abc").continues


@dataclass
class W:
    worker_id: str


def test_round_robin_cycles_and_skips_excluded():
    rr = RoundRobin()
    ws = [W("b"), W("a"), W("c")]
    assert [rr.pick(ws).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.pick(ws, exclude={"a", "b", "c"}) is None
    assert {rr.pick(ws, exclude={"b"}).worker_id for _ in range(4)} == {"a", "c"}
