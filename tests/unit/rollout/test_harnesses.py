"""How a harness episode's end becomes its typed outcome, finish reason and reward (``rollout.harnesses.ended``):
only a harness that exited on its own is graded, a budget stop is a task failure (0.0), and what is not the
policy's doing (a timeout, a crash, a failed engine) has no reward and is an infrastructure error."""

import pytest

from rollout import trajectory as tj
from rollout.agent import AgentConfig
from rollout.harnesses import HarnessConfig, HarnessExit, ended


@pytest.mark.parametrize(("done", "errors", "stopped", "want"), [
    (HarnessExit("Submitted", "42\n"), 0, None, ("graded", "submitted")),
    (HarnessExit("Submitted", "42\n"), 0, "turns", ("graded", "submitted")),     # it submitted before the budget
    (HarnessExit("RepeatedFormatError"), 0, None, ("graded", "submitted")),      # the policy's format: graded
    (HarnessExit("LimitsExceeded"), 0, None, ("budget_stop", "max_turns")),      # the harness's own step limit
    (HarnessExit("RepeatedFormatError"), 0, "tokens", ("budget_stop", "max_tokens")),
    (HarnessExit("RepeatedFormatError"), 0, "wall_s", ("budget_stop", "max_turns")),
    (HarnessExit(error="ValueError: boom"), 0, None, ("harness_error", "harness_error")),
    (HarnessExit(error="APIError: 502"), 1, None, ("infra_error", "policy_error")),
    (None, 0, None, ("timeout", "timeout")),
])
def test_an_end_is_typed(done, errors, stopped, want):
    outcome, finish, error = ended(done, 60.0, errors, stopped)
    assert (outcome, finish) == want
    assert (finish in tj.INFRA_ERRORS) == (outcome in ("timeout", "harness_error", "infra_error"))
    assert bool(error) == (outcome in ("timeout", "harness_error", "infra_error"))


def test_a_harness_config_is_checked_and_follows_the_loops_limits():
    with pytest.raises(ValueError, match="harness must be one of"):
        HarnessConfig("claude-code")
    with pytest.raises(ValueError, match="timeout_s"):
        HarnessConfig(timeout_s=0)
    h = HarnessConfig.for_loop("mini-swe-agent", {"step_limit": 5}, AgentConfig(max_turns=7, max_total_tokens=900,
                                                                                 max_new_tokens=64, temperature=0.5))
    assert (h.budget.turns, h.budget.tokens, h.sampling.max_tokens, h.sampling.temperature) == (7, 900, 64, 0.5)
    assert h.agent == {"step_limit": 5}
