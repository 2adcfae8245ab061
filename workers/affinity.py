"""Pin a whole process tree to a set of CPUs (every thread of every descendant).

vLLM's CPU NIXL connector moves each worker's main thread to the last core of its NUMA node, assuming it owns the
machine; two workers on one small host then compute on the same core while another idles. Pinning each worker's
tree to its own cores after start-up undoes that. Linux only; threads created later inherit the mask.
"""

from __future__ import annotations

import os
from pathlib import Path


def parse_cpus(spec: str) -> set[int]:
    """'0', '0-3', '0,2,5-6' -> CPU ids."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"no CPUs in {spec!r}")
    return cpus


def descendants(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def pin_tree(pid: int, cpus: set[int]) -> int:
    """Set the affinity of every thread in ``pid``'s tree; returns how many threads were pinned."""
    pinned = 0
    for proc in descendants(pid):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{proc}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
                pinned += 1
            except OSError:
                pass  # the thread ended meanwhile
    return pinned
