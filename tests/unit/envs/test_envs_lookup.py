"""Lookup-v0 without Docker: the generator (levels, seeds, splits), the tokens it is made of, episodes on a fake
shell, check_env, forks and snapshots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.wrappers import TimeLimit

import envs
from envs import lookup_env as lk
from envs.lookup_env import HELDOUT_SEED, LookupEnv, make_task, pair_split, resolve, task_ids
from envs.task import TaskError
from policy.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lookup_fakes import ShellBackend  # noqa: E402


def bash(command: str) -> dict:
    return {"name": "bash", "arguments": {"command": command}}


def answer(text: str) -> dict:
    return {"name": "answer", "arguments": {"answer": text}}


def test_names_and_codes_are_single_tokens_and_never_part_of_each_other():
    tok = load_tokenizer()
    words = lk.NAMES + lk.VALUES
    assert len(set(words)) == len(words) and len(lk.NAMES) >= 30 and len(lk.VALUES) >= 30
    for w in words:
        assert len(tok.encode_text(w)) == len(tok.encode_text(" " + w)) == 1, w
        assert len(tok.encode_text(f'"{w}"')) == 3, w  # as a JSON string: quote, word, quote
    assert not [(a, b) for a in words + ("see",) for b in words if a != b and a in b]


@pytest.mark.parametrize("level", lk.LEVELS)
def test_a_task_is_made_again_from_its_id_and_its_answer_is_only_in_the_files(level):
    for seed in (0, 7, 12345, HELDOUT_SEED + 3):
        t = make_task(level, seed)
        assert t == make_task(level, seed) == resolve(t.id) == resolve({"id": t.id}) == resolve(
            {"level": level, "seed": seed}) == resolve(t)
        assert t.answer not in t.question and t.key in t.question and t.level == level
        files = dict(t.files)
        if level == 0:
            assert files == {t.key: t.answer + "\n"} and t.question == f"What code is in the file {t.key}?"
        elif level == 1:
            assert files[t.key] == t.answer + "\n" and len(files) == 3
        elif level == 2:
            lines = [ln for c in files.values() for ln in c.splitlines() if t.key in ln]
            assert lines == [f"{t.key}={t.answer}"] and t.key not in files
        else:
            hop = files[t.key].split()
            assert hop[0] == "see" and files[hop[1]] == t.answer + "\n"
    assert make_task(level, 1).files != make_task(level, 2).files


def test_seeds_split_train_heldout_and_validation_and_they_share_no_question_answer_pair():
    train, held, val = lk.tasks("train", 300), lk.tasks("heldout", 300), lk.tasks("validation", 300)
    assert {t.split for t in train} == {"train"} and {t.split for t in held} == {"heldout"}
    assert {t.split for t in val} == {"validation"}
    assert all(pair_split(t.key, t.answer) == t.split for t in train + held + val)
    pairs = [{(t.key, t.answer) for t in ts} for ts in (train, held, val)]
    assert not pairs[0] & pairs[1] and not pairs[0] & pairs[2] and not pairs[1] & pairs[2]
    # no episode of one split is one of another: what the policy sees (question, files) and answers differs
    contents = [{t.content for t in ts} for ts in (train, held, val)]
    assert not contents[0] & contents[1] and not contents[0] & contents[2] and not contents[1] & contents[2]
    assert {t.level for t in train} == set(lk.LEVELS)
    ids = task_ids("heldout", 6, levels=(2, 3), start=10)
    assert ids == [f"lookup-{lv}-{HELDOUT_SEED + 10 + i}" for i, lv in enumerate([2, 3, 2, 3, 2, 3])]
    assert set(task_ids("train", 50)).isdisjoint(task_ids("train", 50, start=50))
    for bad in ("lookup-4-1", "lookup--1-1", "lookup-1-x", "calc-001", f"lookup-1-{3 * HELDOUT_SEED}"):
        with pytest.raises(TaskError):
            resolve(bad)
    with pytest.raises(ValueError):
        task_ids("test", 1)


def test_distinct_task_ids_list_each_task_once_and_stop_where_the_split_runs_out():
    ids = task_ids("heldout", 100, (0,), words=12, distinct=True)
    contents = [resolve(i).content for i in ids]
    assert len(set(contents)) == len(contents) == len(ids)
    # level 0 has one task per (name, code) pair: 12 x 12 pairs, one in five held out
    pairs = {(n, v) for n in lk.NAMES[:12] for v in lk.VALUES[:12] if pair_split(n, v) == "heldout"}
    assert {(resolve(i).key, resolve(i).answer) for i in ids} == pairs
    assert len(task_ids("heldout", 100, (0,), words=12)) == 100     # without distinct: one per seed
    assert lk.task_key(ids[0]) == resolve(ids[0]).content


@pytest.mark.parametrize("level", lk.LEVELS)
def test_an_episode_is_solved_by_reading_the_sandbox_and_scored_on_the_host(level):
    backend = ShellBackend()
    t = make_task(level, 42)
    with LookupEnv(task=t.id, api=backend) as env:
        obs, info = env.reset()
        assert obs == t.question and info == {"task": t.id, "level": level}
        files = {p: c for p, c in backend.sandboxes[env.sandbox.id].files.items()}
        assert files == {f"/data/{n}": c for n, c in t.files}
        if level == 2:
            obs, reward, term, trunc, info = env.step(bash(f"grep {t.key} *"))
            assert obs.endswith(f":{t.key}={t.answer}\n")
        else:
            obs, *_, info = env.step(bash("cat *" if level == 0 else f"cat {t.key}"))
            if level == 3:
                obs, *_, info = env.step(bash(f"cat {obs.split()[1]}"))
        assert obs.strip().endswith(t.answer) and info["tool"] == "bash"
        obs, reward, term, trunc, info = env.step(answer(f" {t.answer.upper()}."))
        assert (reward, term, trunc, info["correct"], info["expected"]) == (1.0, True, False, True, t.answer)
        assert info["level"] == level
        # the sandbox cannot change what is expected: it is the host's own task
        env.reset()
        env.sandbox.files[f"/data/{t.key}"] = "forged\n"
        *_, info = env.step(answer("forged"))
        assert info["correct"] is False and info["expected"] == t.answer
    assert not backend.sandboxes


def test_bad_actions_and_the_step_limit():
    with LookupEnv(task="lookup-1-5", api=ShellBackend(), max_steps=2) as env:
        env.reset()
        obs, reward, term, trunc, info = env.step("no tool call here")
        assert "no tool call" in obs and (reward, term, trunc) == (0.0, False, False) and info["error"]
        obs, reward, term, trunc, info = env.step(bash("cat nowhere"))
        assert "No such file" in obs and (reward, term, trunc) == (0.0, False, True)


def test_registered_with_its_step_limit_and_passes_check_env():
    assert envs.REGISTERED["agentenv/Lookup-v0"][1] == lk.DEFAULT_MAX_STEPS
    env = gymnasium.make("agentenv/Lookup-v0", api=ShellBackend(), levels=(2,), split="heldout")
    try:
        assert isinstance(env, TimeLimit) and env.spec is not None
        assert env.spec.max_episode_steps == env.unwrapped.max_steps == lk.DEFAULT_MAX_STEPS
        check_env(env.unwrapped, skip_render_check=True)
        _, info = env.reset(seed=3)
        assert info["level"] == 2 and resolve(info["task"]).split == "heldout"
        assert env.reset(seed=3)[0] == env.reset(seed=3)[0]
    finally:
        env.close()
    with LookupEnv(api=ShellBackend(), levels=(1, 3)) as env:
        assert {env.reset(seed=s)[1]["level"] for s in range(12)} == {1, 3}
        assert env.task is not None and env.task.split == "train"
    with pytest.raises(ValueError):
        LookupEnv(levels=(4,))
    with pytest.raises(ValueError):
        LookupEnv(split="dev")


def test_forks_continue_from_one_reset_and_a_snapshot_names_its_task():
    backend = ShellBackend()
    t = make_task(3, 9)
    with LookupEnv(task=t.id, api=backend) as env:
        env.reset()
        env.step(bash(f"cat {t.key}"))
        kids = env.fork(2)
        try:
            assert [k.steps for k in kids] == [1, 1] and all(k.task == t for k in kids)
            hop = dict(t.files)[t.key].split()[1]
            assert kids[0].step(bash(f"cat {hop}"))[0] == t.answer + "\n"
            assert kids[1].step(answer("wrong"))[1] == 0.0 and kids[0].step(answer(t.answer))[1] == 1.0
        finally:
            for k in kids:
                k.close()
        snap = env.snapshot()
    with LookupEnv(api=backend) as other:
        other.reset(options={"snapshot": snap})
        assert other.task == t and other.steps == 1
        assert other.step(answer(t.answer))[1] == 1.0
    assert not backend.sandboxes


def test_the_generator_writes_task_records(capsys):
    assert lk.main(["--split", "heldout", "--n", "4", "--levels", "1,2"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in recs] == task_ids("heldout", 4, (1, 2))
    assert all(r["split"] == "heldout" and resolve(r).id == r["id"] for r in recs)


def test_without_the_answer_tool_a_plain_reply_is_the_answer():
    t = make_task(1, 8)
    with LookupEnv(task=t.id, api=ShellBackend(), answer_tool=False) as env:
        assert env.toolbox.names == ["bash"]
        env.reset()
        obs, reward, term, *_ = env.step("<|open|>tools<|sep|>oops")  # a broken call is not an answer
        assert "malformed" in obs and (reward, term) == (0.0, False)
        obs, reward, term, *_ = env.step('{"name": "bash", "arguments": {"command": "cat ' + t.key + '"}}')
        assert obs == t.answer + "\n" and not term
        obs, reward, term, trunc, info = env.step(f"{t.answer}")
        assert (reward, term, info["answer"], info["correct"], info["calls"]) == (1.0, True, t.answer, True, [])
        env.reset()
        assert env.step("<think>it is</think>nothing")[1:3] == (0.0, True)
    with LookupEnv(api=ShellBackend(), answer_tool=False) as env:
        check_env(env, skip_render_check=True)


def test_fewer_words_make_a_smaller_task_family_with_its_own_ids():
    t = make_task(2, 5, words=12)
    assert t.id == "lookup-2-5-w12" and resolve(t.id) == t == resolve(t.to_json()) and t.words == 12
    used = {w for _, c in t.files for w in c.replace("=", " ").split()} | {n for n, _ in t.files}
    assert used <= set(lk.NAMES[:12] + lk.VALUES[:12])
    assert make_task(2, 5) == resolve("lookup-2-5") and make_task(2, 5).id == "lookup-2-5"
    assert task_ids("heldout", 2, (1,), words=9) == [f"lookup-1-{HELDOUT_SEED}-w9", f"lookup-1-{HELDOUT_SEED + 1}-w9"]
    assert {x.answer for x in lk.tasks("train", 200, words=9)} <= set(lk.VALUES[:9])
    env = gymnasium.make("agentenv/Lookup-v0", api=ShellBackend(), **lk.SMALL_MODEL_KWARGS)
    _, info = env.reset(seed=0)
    assert info["level"] in (0, 1) and info["task"].endswith("-w12") and env.unwrapped.toolbox.names == ["bash"]
    env.close()
    with LookupEnv(api=ShellBackend(), words=10) as env:
        assert env.reset(seed=1)[1]["task"].endswith("-w10")
    for bad in (8, 41):
        with pytest.raises(TaskError):
            make_task(1, 1, words=bad)
        with pytest.raises(ValueError):
            LookupEnv(words=bad)
