"""Weight sync for real: the trainer (k3-mini, the model as served) and our policy server (EP=2 over gloo, its own
process, HTTP). The trainer scores the server's samples as the server did; after a step, ``WeightSync`` writes the
weights and the server loads them through ``/update_weights``; the next samples carry the new weight version and
the trained weights' log-probs."""


import pytest

from policy.client import SyncPolicyClient
from policy.config import model_config
from trainer.algorithm.batch import Batch, Sample
from trainer.distributed.sync import Endpoint, WeightSync
from trainer.train import TrainConfig, Trainer

from ..server_fixtures import k3_mini_server

pytestmark = pytest.mark.integration
TOKEN = "trainer-sync-token"


@pytest.fixture(scope="module")
def server():
    with k3_mini_server(TOKEN, ep=2) as spec:
        yield spec


def _samples(client, version=None):
    out = []
    for i, prompt in enumerate(([5, 17, 300, 42, 7], [9, 8, 7, 6, 5, 4])):
        c = client.complete(prompt, max_tokens=12, temperature=1.0, seed=i)
        s = c.samples[0]
        if version is not None:
            assert c.weight_version == version
        out.append(Sample(prompt + s.token_ids, [0] * len(prompt) + [1] * len(s.token_ids),
                          [0.0] * len(prompt) + list(s.logprobs or []), advantage=1.0 if i == 0 else -1.0,
                          weight_version=c.weight_version or 0))
    return out


def _max_diff(samples, scored):
    return max(abs(a - b) for s, sc in zip(samples, scored, strict=True)
               for a, b, m in zip(sc.logprobs, s.logprobs, s.loss_mask, strict=True) if m)


def test_push_weights_to_a_running_server(server, tmp_path):
    client = SyncPolicyClient(server.base_url, token=TOKEN)
    with Trainer(model_config("k3-mini"), TrainConfig(seed=0, lr=1e-3)) as trainer:
        samples = _samples(client, version=0)
        assert _max_diff(samples, trainer.score(samples)) < 1e-4           # same weights, same numerics
        trainer.step(Batch(samples))
        sync = WeightSync([Endpoint(server.base_url, api_key=TOKEN)], str(tmp_path))
        result = sync.push(trainer)
        assert result.version == 1 and result.load_s[server.base_url] > 0
        fresh = _samples(client, version=1)                                 # the next trajectories record it
        assert all(s.weight_version == 1 for s in fresh)
        assert _max_diff(fresh, trainer.score(fresh)) < 1e-4
        bad = WeightSync([Endpoint(server.base_url, api_key="wrong")], str(tmp_path / "b"))
        with pytest.raises(Exception, match="401"):
            bad.push(trainer)
        sync.close()
    client.close()
