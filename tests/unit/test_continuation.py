from dataclasses import dataclass

from kvshuttle.control_plane.continuation import plan_continuation
from kvshuttle.control_plane.selection import RoundRobin


def test_extension_splices_onto_exact_ids():
    c = plan_continuation("<s>user: hi\nbot: yo", [1, 2, 3], "<s>user: hi\nbot: yo\nuser: more")
    assert c.continues and c.prefix_ids == (1, 2, 3) and c.suffix_text == "\nuser: more"


def test_edited_history_starts_over():
    c = plan_continuation("<s>user: hi\nbot: yo", [1, 2, 3], "<s>user: HI\nbot: yo\nuser: more")
    assert not c.continues and c.suffix_text.startswith("<s>user: HI")


def test_no_previous_turn():
    assert not plan_continuation("", [], "abc").continues


@dataclass
class W:
    worker_id: str


def test_round_robin_cycles_and_skips_excluded():
    rr = RoundRobin()
    ws = [W("b"), W("a"), W("c")]
    assert [rr.pick(ws).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.pick(ws, exclude={"a", "b", "c"}) is None
    assert {rr.pick(ws, exclude={"b"}).worker_id for _ in range(4)} == {"a", "c"}
