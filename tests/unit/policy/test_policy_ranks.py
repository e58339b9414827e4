"""policy.ranks on one rank: the typed ops say whether ranks reply, and rank 0's end runs its own handler (the
broadcast and gather with several ranks: test_policy_engine's EP engines and the trainer's world-2 tests)."""

from dataclasses import dataclass

import pytest

from policy.ranks import Op, Ranks, Stop
from policy.runner import LoadWeights, StepPlan
from trainer.distributed.rank import FullState, LoadCheckpoint, SaveCheckpoint, SaveWeights, Score, Step


@dataclass(frozen=True)
class Echo(Op[int]):
    value: int


def test_one_rank_runs_rank_0_s_handler_and_returns_its_result():
    seen: list[Echo] = []

    def handle(op: Echo) -> int:
        seen.append(op)
        return op.value * 2

    ranks = Ranks(1, handle)
    assert ranks.call(Echo(21)) == [42] and seen == [Echo(21)]
    ranks.send(Echo(1))   # nothing to send to with one rank
    ranks.stop()
    assert seen == [Echo(21)]


def test_an_op_that_is_only_sent_cannot_be_called():
    with pytest.raises(AssertionError, match="only sent"):
        Ranks(1, lambda op: None).call(LoadWeights("w.safetensors"))


def test_which_ops_the_ranks_reply_to():
    assert not Stop.replied and not LoadWeights.replied and StepPlan.replied
    assert all(op.replied for op in (Step, Score, SaveWeights, FullState, SaveCheckpoint, LoadCheckpoint))
