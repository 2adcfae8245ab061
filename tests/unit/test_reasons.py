"""Every way a plan is decided yields its reason code from the fixed vocabulary (metrics label turns with it)."""

from __future__ import annotations

import json

import grpc
import pytest
from kvshuttle.control_plane import reasons
from kvshuttle.control_plane.cost_model import PrefillPrior
from kvshuttle.control_plane.decision import Choice, PullPolicy, decide
from kvshuttle.control_plane.load import WorkerLoad
from kvshuttle.control_plane.policies import Outcome
from kvshuttle.control_plane.prefix import prefix_digest
from kvshuttle.services.scheduler.claims import ClaimsError
from kvshuttle.services.scheduler.planning import demote, store_failure

from tests.support.planning import COVERED, HISTORY, PROMPT, handle_view, plan, planner

POLICY = PullPolicy(pull_threshold_tokens=16, expiry_guard_s=2.0)


def _edited(at: int) -> list[int]:
    out = HISTORY.copy()
    out[at] = 1
    return out


# (prompt, handle overrides or None for no record, disable_pull) -> the code the safety rules give
DECIDE_CASES = {
    "pull_all": (PROMPT, {}, False, reasons.PULL_ALL),
    "pull_prefix": (_edited(40) + [5], {}, False, reasons.PULL_PREFIX),
    "pull_disabled": (PROMPT, {}, True, reasons.PULL_DISABLED),
    "no_record": (PROMPT, None, False, reasons.NO_RECORD),
    "claimed": (PROMPT, {"claimed": True}, False, reasons.HANDLE_USED),
    "no handle": (PROMPT, {"kv_transfer_params_json": ""}, False, reasons.HANDLE_USED),
    "expired": (PROMPT, {"expires_in_s": -1.0}, False, reasons.EXPIRED),
    "expires within the guard": (PROMPT, {"expires_in_s": 1.0}, False, reasons.EXPIRED),
    "source gone": (PROMPT, {"source_alive": False}, False, reasons.DECODE_WORKER_UNAVAILABLE),
    "bad block size": (PROMPT, {"block_size": 0}, False, reasons.INCONSISTENT_RECORD),
    "no digest": (PROMPT, {"prefix_digest": b""}, False, reasons.INCONSISTENT_RECORD),
    "diverged": (_edited(3), {}, False, reasons.DIVERGED),
    "too few tokens": (HISTORY[:20], {"covered_tokens": 10, "prefix_digest": prefix_digest(HISTORY, 10),
                                      "checkpoints": ()}, False, reasons.BELOW_THRESHOLD),
    "unusable handle": (PROMPT, {"kv_transfer_params_json": "{}"}, False, reasons.HANDLE_UNUSABLE),
}


@pytest.mark.parametrize("case", DECIDE_CASES)
def test_every_safety_rule_has_its_code(case):
    prompt, over, disable, code = DECIDE_CASES[case]
    got = decide(prompt, None if over is None else handle_view(**over), POLICY, disable_pull=disable)
    assert got.code == code, got.reason
    assert got.code in reasons.VOCABULARY
    assert (got.choice is Choice.PULL) == (code in reasons.PULL_CODES)


def test_the_cases_cover_every_code_decide_can_give():
    assert {case[3] for case in DECIDE_CASES.values()} == {
        reasons.PULL_ALL, reasons.PULL_PREFIX, reasons.PULL_DISABLED, reasons.NO_RECORD, reasons.HANDLE_USED,
        reasons.EXPIRED, reasons.DECODE_WORKER_UNAVAILABLE, reasons.INCONSISTENT_RECORD, reasons.DIVERGED,
        reasons.BELOW_THRESHOLD, reasons.HANDLE_UNUSABLE}


def test_policy_decisions_have_their_codes():
    got = plan(planner())  # the cost policy pulls when predicted faster: the safety rule's code stays
    assert got.plan.choice is Choice.PULL and got.plan.code == reasons.PULL_ALL

    got = plan(planner(PrefillPrior(ms_per_kpulled=50.0, ms_per_transfer=20.0)))  # priors: a pull is slower...
    assert got.plan.choice is Choice.PULL and got.plan.code == reasons.PULL_EXPLORE  # ...but the link is unmeasured

    slow = planner(PrefillPrior(ms_per_kpulled=5000.0, ms_per_transfer=100.0))
    for _ in range(3):
        slow.observe(Outcome("p0", 103, 99, 4, 600.0, Choice.PULL, source_worker="d", policy="cost"))
    got = plan(slow)
    assert got.plan.choice is Choice.RECOMPUTE and got.plan.code == reasons.COST_MODEL

    p = planner()
    for _ in range(6):  # pulls on this link take ~3 s
        p.observe(Outcome("p0", 103, 99, 4, 3000.0, Choice.PULL, source_worker="d", policy="t16"))
    got = plan(p, handle=handle_view(expires_in_s=9.0), loads={"p0": WorkerLoad(running=1, waiting=2)}, policy="t16")
    assert got.plan.choice is Choice.RECOMPUTE and got.plan.code == reasons.WOULD_EXPIRE

    got = plan(planner(t200="threshold:pull_threshold_tokens=200"), policy="t200")
    assert got.plan.code == reasons.BELOW_THRESHOLD and got.plan.pullable_tokens == COVERED


@pytest.mark.parametrize("code,want", [
    (grpc.StatusCode.UNAVAILABLE, reasons.STORE_UNAVAILABLE), (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                              reasons.STORE_UNAVAILABLE),
    (grpc.StatusCode.INTERNAL, reasons.STORE_ERROR), (grpc.StatusCode.PERMISSION_DENIED, reasons.STORE_ERROR),
])
def test_the_scheduler_s_store_failures_have_their_codes(code, want):
    got, text = store_failure(ClaimsError(code, "x"), "could not claim the KV handle")
    assert got == want and text.endswith("recompute")
    demoted = demote(decide(PROMPT, handle_view(), POLICY), got, text)
    assert demoted.choice is Choice.RECOMPUTE and demoted.code == want


def test_the_vocabulary_is_small_fixed_and_labels_stay_in_it():
    groups = (reasons.PULL_CODES, reasons.LOCAL_CODES, reasons.RECOMPUTE_CODES)
    assert len(reasons.VOCABULARY) == sum(map(len, groups)) + 1 < 32
    assert len(set().union(*groups)) == sum(map(len, groups))  # each code in one decision
    assert all(code.isidentifier() and code.islower() for code in reasons.VOCABULARY)
    assert reasons.known("pull_all") == "pull_all"
    assert reasons.known("prompt extends the recorded 99 tokens") == reasons.UNKNOWN
    assert reasons.known("") == reasons.UNKNOWN


def test_the_scheduler_and_gateway_codes_are_only_those_of_the_vocabulary():
    """Every reason code a module names (``why.X`` / ``reasons.X``) exists in kvshuttle.control_plane.reasons."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    used = set()
    for path in [*root.glob("control_plane/*.py"), *root.glob("services/**/*.py")]:
        used |= set(re.findall(r"\bwhy\.([A-Z_]+)\b", path.read_text()))
    assert used, "no module names a reason code"
    assert {getattr(reasons, name) for name in used} <= reasons.VOCABULARY | set(reasons.RECORD_OUTCOMES)
    # the gateway's own codes are used where it overrides the scheduler's decision
    turns = "".join(path.read_text() for path in (root / "services/gateway/turns").glob("*.py"))
    assert "why.PULL_FAILED" in turns and "why.WORKER_FAILED" in turns
    assert json.dumps(sorted(reasons.VOCABULARY))  # plain strings


def test_record_outcomes_are_described_and_failed_writes_are_never_recorded():
    assert set(reasons.RECORD_DESCRIPTIONS) == set(reasons.RECORD_OUTCOMES)
    assert not set(reasons.RECORD_OUTCOMES) & reasons.VOCABULARY  # another label: the decision's codes stay apart
    assert reasons.record_outcome("INVALID_ARGUMENT") == reasons.RECORD_REFUSED
    assert {reasons.record_outcome(c) for c in ("UNAVAILABLE", "DEADLINE_EXCEEDED")} == {reasons.RECORD_UNAVAILABLE}
    assert {reasons.record_outcome(c) for c in ("INTERNAL", "FAILED_PRECONDITION", "UNKNOWN")} == {
        reasons.RECORD_ERROR}
