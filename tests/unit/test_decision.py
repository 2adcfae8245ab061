"""The pull-vs-recompute decision for one handle: what is reusable, and when a pull is refused."""

from __future__ import annotations

import pytest
from kvshuttle.control_plane.decision import Choice, PullPolicy, decide, reusable_tokens

from tests.support.planning import BS, COVERED, HISTORY, PROMPT, handle_view

POLICY = PullPolicy(pull_threshold_tokens=16, expiry_guard_s=2.0)


def test_extension_pulls_everything_covered():
    plan = decide(HISTORY + [1, 2, 3], handle_view(), POLICY)
    assert plan.choice is Choice.PULL
    assert plan.reusable_tokens == COVERED and plan.compute_tokens == 4
    assert plan.prefill_params["remote_num_tokens"] == COVERED
    assert len(plan.prefill_params["remote_block_ids"][0]) == 7  # ceil(99/16)
    assert "extends" in plan.reason


def test_divergence_pulls_only_whole_blocks_of_the_last_matching_checkpoint():
    edited = HISTORY.copy()
    edited[40] = 1  # after checkpoint 37 (2 whole blocks), before checkpoint 70
    plan = decide(edited + [5], handle_view(), POLICY)
    assert plan.choice is Choice.PULL and plan.reusable_tokens == 32
    assert plan.prefill_params["remote_block_ids"] == [list(range(2))]
    assert plan.prefill_params["remote_num_tokens"] == 32
    edited[75] = 1  # still the same: the first difference decides
    assert decide(edited + [5], handle_view(), POLICY).reusable_tokens == 32
    edited = HISTORY.copy()
    edited[90] = 1  # after checkpoint 70: 4 whole blocks
    assert decide(edited + [5], handle_view(), POLICY).reusable_tokens == 64
    # Without checkpoints only the whole covered prefix can be proven: any divergence recomputes.
    plan = decide(edited + [5], handle_view(checkpoints=()), POLICY)
    assert plan.choice is Choice.RECOMPUTE and plan.reusable_tokens == 0


def test_the_callers_count_of_equal_ids_is_pulled_where_the_digests_prove_fewer():
    edited = HISTORY.copy()
    edited[66] = 1  # after checkpoint 37 (2 whole blocks); the caller compared the ids: 66 are equal (4 blocks)
    plan = decide(edited + [5], handle_view(verified_tokens=66), POLICY)
    assert plan.choice is Choice.PULL and plan.reusable_tokens == 64 and plan.matched_tokens == 66
    assert plan.prefill_params["remote_num_tokens"] == 64
    # never more than the handle covers, nor the prompt's last token
    assert decide(HISTORY + [5], handle_view(verified_tokens=500), POLICY).reusable_tokens == COVERED
    short = HISTORY[:50]
    assert decide(short, handle_view(verified_tokens=50), POLICY).matched_tokens == 50
    assert decide(short, handle_view(verified_tokens=50), POLICY).reusable_tokens == 48  # 49 usable, 3 blocks
    # without the count, only the digests' proof counts
    assert decide(edited + [5], handle_view(), POLICY).reusable_tokens == 32


def test_divergence_in_first_block_recomputes():
    edited = HISTORY.copy()
    edited[3] = 1
    plan = decide(edited, handle_view(), POLICY)
    assert plan.choice is Choice.RECOMPUTE and "diverges" in plan.reason
    assert plan.prefill_params["do_remote_decode"] is True and plan.prefill_params["remote_block_ids"] is None


@pytest.mark.parametrize("over,word", [
    ({"expires_in_s": -1.0}, "expire"), ({"expires_in_s": 1.0}, "expire"), ({"claimed": True}, "already"),
    ({"kv_transfer_params_json": ""}, "already"), ({"source_alive": False}, "not alive"),
    ({"kv_transfer_params_json": "{}"}, "unusable"),
    # a forged or corrupt record: no arithmetic on it (block size 0 used to raise ZeroDivisionError)
    ({"block_size": 0}, "inconsistent"), ({"block_size": -4}, "inconsistent"), ({"covered_tokens": -1}, "inconsistent"),
    ({"prefix_digest": b""}, "inconsistent"), ({"covered_tokens": 0}, "inconsistent"),
])
def test_never_pulls_unusable_handles(over, word):
    plan = decide(HISTORY + [1], handle_view(**over), POLICY)
    assert plan.choice is Choice.RECOMPUTE and word in plan.reason and plan.reusable_tokens == 0


def test_a_covered_count_the_digest_does_not_prove_is_not_pulled():
    # The record says it covers one block more than its digest was made of: the digest proves nothing, and only the
    # checkpoints' whole blocks may be pulled.
    plan = decide(PROMPT + [0] * 20, handle_view(covered_tokens=COVERED + BS), POLICY)
    assert plan.choice is Choice.PULL and plan.reusable_tokens == 64


def test_no_session_or_disabled_recomputes_with_reason():
    assert "no recorded" in decide([1, 2], None, POLICY).reason
    assert "disabled" in decide(HISTORY + [1], handle_view(), POLICY, disable_pull=True).reason


def test_threshold():
    plan = decide(HISTORY + [1], handle_view(), PullPolicy(pull_threshold_tokens=200))
    assert plan.choice is Choice.RECOMPUTE and "threshold 200" in plan.reason


def test_prompt_equal_to_covered_tokens_leaves_one_token_to_compute():
    assert reusable_tokens(matched=99, covered=99, prompt_len=99, block_size=BS) == 96
    assert reusable_tokens(matched=99, covered=99, prompt_len=100, block_size=BS) == 99


def test_empty_prompt_is_an_error():
    with pytest.raises(ValueError):
        decide([], None, POLICY)
