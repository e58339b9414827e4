"""A generation cut off by a weight update (``sync_mode = "abort"``) is not the agent's answer: the turn is asked
again on the new weights and records their version; when every try is aborted the episode is a ``policy_error``,
never graded. Our real server app answers, on a stand-in engine that aborts its first generations the way
``policy.engine.Engine.update_weights(mode="abort")`` does (finish_reason "abort", abort_reason "weights_updated",
the old version) and then serves the new weights."""

import asyncio
import sys
import threading
from pathlib import Path

import gymnasium
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_fakes import FORKY, TOK, FakeBackend  # noqa: E402

from policy.client import PolicyClient  # noqa: E402
from policy.engine import SamplingParams, Sequence  # noqa: E402
from policy.server import create_app  # noqa: E402
from rollout import scripted  # noqa: E402
from rollout.agent import AgentConfig, run_episode  # noqa: E402

SUBMIT = scripted.tool_call("bash", {"command": "submit"})


class AbortingEngine:
    """Answers SUBMIT; its first ``aborts`` generations stop half way as aborted by a weight update (which then
    lands: the version goes up by one)."""

    def __init__(self, aborts: int) -> None:
        self.tokenizer, self.max_context, self.weight_version = TOK._tok, 4096, 0
        self.aborts, self.generations = aborts, []
        self._ids = iter(range(10**6))

    def submit(self, prompt_ids, params: SamplingParams, listener=None) -> Sequence:
        seq = Sequence(next(self._ids), list(prompt_ids), params, listener, weight_version=self.weight_version)
        ids = TOK.encode_assistant(SUBMIT) + [TOK.eos_id]
        aborted = self.aborts > 0
        if aborted:
            self.aborts -= 1
            ids = ids[: len(ids) // 2]
        threading.Thread(target=self._run, args=(seq, ids, aborted)).start()
        return seq

    def _run(self, seq: Sequence, ids, aborted: bool) -> None:
        seq.output_ids, seq.logprobs = list(ids), [-0.5] * len(ids)
        seq.text = TOK.decode(ids)
        if aborted:
            seq.finish_reason, seq.abort_reason = "abort", "weights_updated"
            self.weight_version += 1
        else:
            seq.finish_reason = "stop"
        self.generations.append((seq.weight_version, seq.finish_reason))
        seq.done.set()
        seq.listener(seq)

    def metrics(self):
        return {}


def _episode(engine: AbortingEngine, config: AgentConfig):
    app = create_app(engine, "t")  # type: ignore[arg-type]
    backend = FakeBackend()
    env = gymnasium.make(FORKY, api=backend)

    async def go():
        async with PolicyClient("http://ours", token="t", transport=httpx.ASGITransport(app=app),
                                max_retries=0) as policy:
            return await run_episode(env, policy, TOK, config, task_id="t1", env_id=FORKY)

    try:
        return asyncio.run(go()), env
    finally:
        env.close()


def test_an_aborted_generation_is_asked_again_on_the_new_weights():
    engine = AbortingEngine(aborts=1)
    traj, env = _episode(engine, AgentConfig(max_turns=3))
    assert engine.generations == [(0, "abort"), (1, "stop")]
    assert len(traj.turns) == 1 and traj.weight_versions == [1]      # the kept generation's version
    t = traj.turns[0]
    assert TOK.decode(traj.token_ids[t.start:t.start + t.generated]) == SUBMIT + "<|im_end|>"
    assert traj.finish_reason == "submitted" and traj.reward == 1.0
    assert traj.metadata["aborted_generations"] == 1


def test_an_episode_whose_every_try_is_aborted_is_a_policy_error_not_graded():
    engine = AbortingEngine(aborts=10)
    traj, env = _episode(engine, AgentConfig(max_turns=3, abort_retries=2))
    assert [f for _, f in engine.generations] == ["abort"] * 3
    assert traj.finish_reason == "policy_error" and traj.reward is None and "aborted 3 times" in traj.error
    assert traj.turns == [] and env.unwrapped.steps == 0             # the env never saw the truncated text
