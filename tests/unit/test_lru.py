"""BoundedLru: size-bounded, least recently used out first."""

from kvshuttle.control_plane.lru import BoundedLru


def test_evicts_least_recently_used_beyond_the_budget():
    lru: BoundedLru[str] = BoundedLru(10)
    lru.put("a", "A", 4)
    lru.put("b", "B", 4)
    assert lru.get("a") == "A"  # a is now the most recent
    lru.put("c", "C", 4)  # 12 > 10: b goes
    assert lru.get("b") is None and lru.get("a") == "A" and lru.get("c") == "C"
    assert lru.bytes == 8 and len(lru) == 2


def test_replacing_and_discarding_keep_the_byte_count():
    lru: BoundedLru[int] = BoundedLru(100)
    lru.put("k", 1, 30)
    lru.put("k", 2, 50)
    assert lru.get("k") == 2 and lru.bytes == 50
    lru.discard("k")
    lru.discard("missing")
    assert lru.get("k") is None and lru.bytes == 0


def test_a_value_larger_than_the_budget_is_not_kept():
    lru: BoundedLru[str] = BoundedLru(5)
    lru.put("big", "x", 6)
    assert lru.get("big") is None and lru.bytes == 0
