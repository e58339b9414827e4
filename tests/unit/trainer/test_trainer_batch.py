"""Trajectories to tensors: the shift by one (position t predicts token t + 1, with its mask, rollout log-prob,
advantage and replayed routing), padding, micro-batches by token budget, the split over ranks."""

import random
import sys
from pathlib import Path

import pytest
import torch

from trainer.algorithm.batch import Sample, chunks, collate, pack, split_ranks

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import make_traj  # noqa: E402


def test_collate_aligns_every_tensor_to_the_predicted_token():
    a = Sample([10, 11, 12, 13, 14], [0, 0, 1, 1, 0], [0.0, 0.0, -0.5, -1.5, 0.0], advantage=0.7,
               routing=[[[0, 1], [2, 3]], [[1, 2], [3, 4]], [[5, 6], [7, 0]], None])
    b = Sample([20, 21, 22], [0, 1, 1], [0.0, -0.1, -0.2], advantage=-1.0, routing=None)
    mb = collate([a, b], pad_id=9, routing_shape=(2, 2))
    assert mb.input_ids.tolist() == [[10, 11, 12, 13], [20, 21, 22, 9]]
    assert mb.targets.tolist() == [[11, 12, 13, 14], [21, 22, 9, 9]]
    assert mb.mask.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]]
    assert torch.allclose(mb.rollout_logprobs, torch.tensor([[0, -0.5, -1.5, 0], [-0.1, -0.2, 0, 0]]))
    assert mb.advantages[0, :4].tolist() == pytest.approx([0.7] * 4) and mb.advantages[1, 2:].tolist() == [0, 0]
    assert mb.tokens == 4
    # position t replays the routing recorded at position t: prompt position 0 too; nothing recorded at 3, nor in b
    assert mb.routing is not None and mb.routing.shape == (2, 4, 2, 2)
    assert mb.routing[0, 0].tolist() == [[0, 1], [2, 3]]
    assert mb.routing[0, 1].tolist() == [[1, 2], [3, 4]] and mb.routing[0, 2].tolist() == [[5, 6], [7, 0]]
    assert (mb.routing[0, 3] == -1).all() and (mb.routing[1] == -1).all()
    assert mb.valid is not None and mb.valid.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]    # padding is not a position
    assert collate([a]).routing is None


def test_collate_refuses_routing_that_does_not_fit():
    s = Sample([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], routing=[[[1, 2]]] * 4)
    with pytest.raises(ValueError, match="routing entries"):
        collate([s], routing_shape=(1, 2))
    s.routing = [[[1, 2, 3]], [[1, 2, 3]]]
    with pytest.raises(ValueError, match="MoE layers"):
        collate([s], routing_shape=(1, 2))


def test_sample_from_trajectory_keeps_the_record():
    rng = random.Random(0)
    t = make_traj(rng, "g", 0, 1.0, routing=(3, 2))
    t.turns[1].weight_version = 2
    s = Sample.from_trajectory(t, advantage=0.25)
    assert s.token_ids == t.token_ids and s.loss_mask == t.loss_mask and s.logprobs == t.logprobs
    assert s.routing == t.routing and s.weight_version == 0 and s.advantage == 0.25
    assert s.loss_tokens == t.generated_tokens
    mb = collate([s], routing_shape=(3, 2))
    assert int((mb.routing[0, :, 0, 0] >= 0).sum()) == len(t.token_ids) - 1     # every fed position


def test_pack_keeps_each_micro_batch_within_the_budget():
    lengths = [5, 30, 12, 12, 7, 64, 3, 20]
    mbs = pack(lengths, 40)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    for mb in mbs:
        longest = max(lengths[i] for i in mb)
        assert len(mb) * longest <= 40 or len(mb) == 1
    assert [5] in mbs   # longer than the budget: alone
    assert len(pack(lengths, 10_000)) == 1


def test_split_ranks_balances_tokens_deterministically():
    lengths = [50, 10, 40, 30, 20, 25]
    parts = split_ranks(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= 15
    assert split_ranks(lengths, 2) == parts
    assert split_ranks([5], 2) == [[0], []]


def test_chunks_split_contiguously():
    assert chunks(range(7), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert chunks(range(2), 4) == [[0], [1]]
    assert chunks([], 2) == [[]]


def test_padding_does_not_change_a_causal_models_logprobs():
    from trainer_helpers import tiny_cfg

    from policy.model import K3Model
    from trainer.algorithm.losses import token_logprobs
    torch.manual_seed(0)
    model = K3Model(tiny_cfg()).double()
    a = Sample(list(range(1, 12)), [0] * 3 + [1] * 8, [0.0] * 11)
    b = Sample(list(range(20, 25)), [0, 0, 1, 1, 1], [0.0] * 5)
    both = collate([a, b])
    alone = collate([b])
    lp_both, _ = token_logprobs(model(both.input_ids)[0], both.targets)
    lp_alone, _ = token_logprobs(model(alone.input_ids)[0], alone.targets)
    assert torch.allclose(lp_both[1, :4], lp_alone[0], atol=1e-10)


def test_a_harness_episodes_other_branches_are_samples_of_its_advantage():
    """docs/harnesses.md: each branch of a harness episode is a sample with its own mask and its episode's
    advantage; a branch of an episode left out (an infrastructure error) is left out too."""
    from trainer.algorithm.batch import rl_batch

    rng = random.Random(0)
    win, lose = make_traj(rng, "g", 0, reward=1.0), make_traj(rng, "g", 1, reward=0.0)
    broken = make_traj(rng, "h", 0, reward=None)
    broken.finish_reason = "harness_error"
    side_win, side_lose, side_broken = make_traj(rng, "g", 0), make_traj(rng, "g", 1), make_traj(rng, "h", 0)
    batch = rl_batch([win, lose, broken], branches=[side_win, side_lose, side_broken])
    by_tokens = {tuple(s.token_ids): s.advantage for s in batch.samples}
    assert len(batch.samples) == 4 and tuple(side_broken.token_ids) not in by_tokens
    assert by_tokens[tuple(side_win.token_ids)] == by_tokens[tuple(win.token_ids)] > 0
    assert by_tokens[tuple(side_lose.token_ids)] == by_tokens[tuple(lose.token_ids)] < 0
    assert batch.stats["episodes"] == 3.0            # branches are samples, not episodes
