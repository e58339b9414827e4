"""The imperfect demonstrator of the warm start: on a seeded fraction of the tasks it answers at once with a random
code (right only by luck); on the others it is the expert of rollout.experts. Every episode is written."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "envs"))
from fakes import FakeBackend  # noqa: E402

from envs.lookup_env import VALUES, task_ids  # noqa: E402
from rollout.trajectory import read  # noqa: E402
from trainer.demos import guessing_script, write_demonstrations  # noqa: E402

PROMPT = "<|im_user|>user<|im_middle|>What code is in file layer?<|im_end|><|im_assistant|>assistant<|im_middle|>"


def test_the_guessing_demonstrator_answers_at_once_with_a_code_seeded_by_run_and_prompt():
    script = guessing_script(list(VALUES), answer_tool=False, seed=3)
    prompts = [PROMPT.replace("layer", name) for name in ("layer", "cache", "kernel", "router", "token", "model",
                                                           "policy", "device", "expert", "block")]
    first = [script(p, 0) for p in prompts]
    assert set(first) <= set(VALUES) and len(set(first)) > 3                # codes only, drawn, not looked up
    # the same run and task guess the same code, in whatever order the episodes ask: demonstrations repeat
    again = guessing_script(list(VALUES), answer_tool=False, seed=3)
    assert [again(p, 0) for p in reversed(prompts)] == list(reversed(first))
    other = guessing_script(list(VALUES), answer_tool=False, seed=4)
    assert [other(p, 0) for p in prompts] != first
    assert "answer" in guessing_script(list(VALUES), answer_tool=True)(PROMPT, 0)


def _played(tmp_path, name, guess, seed=0):
    import trainer.demos as demos

    backend = FakeBackend()
    ids = task_ids("train", 12, [1], words=9)
    report = demos.write_demonstrations("agentenv/Lookup-v0", ids, tmp_path / name, 12, seed=seed,
                                        env_kwargs={"api": backend, "answer_tool": False, "words": 9}, guess=guess)
    return report, list(read(tmp_path / name))


def test_which_tasks_guess_is_a_seeded_coin_per_task(tmp_path):
    report, trajs = _played(tmp_path, "a", 0.5)
    guessed = sorted(t.task_id for t in trajs if len(t.turns) == 1)
    assert 0 < len(guessed) < 12
    _, again = _played(tmp_path, "b", 0.5)
    assert sorted(t.task_id for t in again if len(t.turns) == 1) == guessed   # the same tasks, however interleaved
    _, never = _played(tmp_path, "c", 0.0)
    assert all(len(t.turns) == 2 for t in never)                              # the plain expert always looks


def test_every_episode_is_written(tmp_path, monkeypatch):
    import trainer.demos as demos

    backend = FakeBackend()
    ids = task_ids("train", 12, [1], words=9)
    report = demos.write_demonstrations("agentenv/Lookup-v0", ids, tmp_path / "d", 12,
                                        env_kwargs={"api": backend, "answer_tool": False, "words": 9}, guess=0.5)
    trajs = list(read(tmp_path / "d"))
    assert report["episodes"] == len(trajs) == 12 and report["infra_errors"] == 0
    assert report["guessed"] + report["looked"] == 12
    assert sorted(len(t.turns) for t in trajs) == [1] * report["guessed"] + [2] * report["looked"]
    assert all(t.reward is not None for t in trajs)                     # failures are written too (fake files)
    assert write_demonstrations is demos.write_demonstrations
