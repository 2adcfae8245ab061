from dataclasses import dataclass

from kvshuttle.control_plane.continuation import (
    Boundary,
    common_prefix,
    last_message_end,
    plan_continuation,
    text_key,
)
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


# A recorded text: a prompt of two messages, then the answer; its ids are one per character, offset by 1000 (so that
# a test can tell spliced ids from tokenized ones).
RECORDED = "<u>hi<end><u>more<end><a><think>why</think>ok<end>"
RECORDED_IDS = [1000 + ord(c) for c in RECORDED]


def cut(text: str) -> Boundary:
    """The boundary of RECORDED at the end of ``text`` (a prefix of it)."""
    assert RECORDED.startswith(text)
    return Boundary(text_key(text), len(text), len(text))


BOUNDARIES = [cut("<u>hi<end>"), cut("<u>hi<end><u>more<end>")]


def test_a_history_that_differs_in_the_last_answer_continues_the_longest_boundary_it_extends():
    dropped = "<u>hi<end><u>more<end><a>ok<end><u>next<end><a>"  # the answer's reasoning dropped on the way back
    c = plan_continuation(len(RECORDED), text_key(RECORDED), RECORDED_IDS, dropped, BOUNDARIES)
    assert c.continues and c.boundary == BOUNDARIES[1] and c.prefix_chars == len("<u>hi<end><u>more<end>")
    assert c.prefix_ids == tuple(RECORDED_IDS[:c.prefix_chars]) and c.suffix_text == "<a>ok<end><u>next<end><a>"
    # the whole text still wins when the echo is exact
    exact = plan_continuation(len(RECORDED), text_key(RECORDED), RECORDED_IDS, RECORDED + "<u>n<end>", BOUNDARIES)
    assert exact.boundary is None and exact.prefix_ids == tuple(RECORDED_IDS) and exact.prefix_chars == len(RECORDED)
    # an edit inside the second message falls back to the first boundary; inside the first, to nothing
    edited = plan_continuation(len(RECORDED), text_key(RECORDED), RECORDED_IDS, "<u>hi<end><u>MORE<end><a>",
                               BOUNDARIES)
    assert edited.boundary == BOUNDARIES[0] and edited.prefix_ids == tuple(RECORDED_IDS[:len("<u>hi<end>")])
    assert not plan_continuation(len(RECORDED), text_key(RECORDED), RECORDED_IDS, "<u>HI<end><a>", BOUNDARIES).continues


def test_a_boundary_is_continued_only_with_text_past_it_and_the_ids_it_names():
    at = BOUNDARIES[0]
    assert not plan_continuation(0, b"", RECORDED_IDS, "<u>hi<end>", [at]).continues  # nothing past it
    assert not plan_continuation(0, b"", RECORDED_IDS[:3], "<u>hi<end><a>", [at]).continues  # ids missing
    wrong = Boundary(text_key("<u>hi<end>"), len("<u>hi<end>") - 1, 5)  # a key that is not the text's at chars
    assert not plan_continuation(0, b"", RECORDED_IDS, "<u>hi<end><a>", [wrong]).continues


def test_where_the_last_message_of_a_prompt_ends():
    assert last_message_end("<u>hi<end><u>more<end><a>", ["<end>"]) == len("<u>hi<end><u>more<end>")
    assert last_message_end("<u>hi<end><u>x</s><a>", ["<end>", "</s>"]) == len("<u>hi<end><u>x</s>")
    assert last_message_end("<u>hi<a>", ["<end>"]) == 0 and last_message_end("abc", []) == 0


def test_the_common_prefix_of_two_id_lists():
    a = list(range(5000))
    assert common_prefix(a, a) == 5000 and common_prefix(a, a[:1200]) == 1200
    b = [*a[:3000], -1, *a[3001:]]
    assert common_prefix(a, b) == 3000 and common_prefix(a, tuple(b), start=2999) == 3000
    assert common_prefix([], a) == 0 and common_prefix([1, 2], [2, 2]) == 0


@dataclass
class W:
    worker_id: str


def test_round_robin_cycles_and_skips_excluded():
    rr = RoundRobin()
    ws = [W("b"), W("a"), W("c")]
    assert [rr.pick(ws).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.pick(ws, exclude={"a", "b", "c"}) is None
    assert {rr.pick(ws, exclude={"b"}).worker_id for _ in range(4)} == {"a", "c"}
