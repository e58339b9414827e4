"""TRL: SWE-v0 and Lookup-v0 rollouts on real sandboxes through ``GRPOTrainer(environment_factory=...)`` (TRL 1.16):
one real training step each with a scripted tiny model (``trl_scripted``: a group of two, one rollout right and one
wrong, rewarded 1 and 0 by our grader through ``get_reward``), and the contract piece by piece: the tools TRL finds
on the class and their schemas (transformers' ``get_json_schema``), ``reset(**row)``, tool calls by name."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

pytest.importorskip("trl")
from transformers.utils import get_json_schema  # noqa: E402

from envs.frameworks.trl import LookupEnvironment, SWEEnvironment  # noqa: E402
from envs.task import Task  # noqa: E402

from .conftest import GOLD_PATH  # noqa: E402

pytestmark = pytest.mark.integration


def tools_as_trl_finds_them(env: Any) -> dict[str, Any]:
    """What ``GRPOTrainer`` exposes as tools: the class's public functions but ``reset`` and ``get_reward``."""
    return {name: getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")}


def rollout(factory: Any, row: dict[str, Any], calls: list[tuple[str, dict[str, Any]]]) -> tuple[str, list[str], float]:
    """One rollout as TRL runs it: reset with the row, each tool call by name, then the reward."""
    env = factory()
    try:
        tools = tools_as_trl_finds_them(env)
        first = env.reset(**row)
        outputs = [tools[name](**arguments) for name, arguments in calls]
        return first, outputs, env.get_reward()
    finally:
        env._close()


def test_the_tools_trl_finds_and_their_schemas() -> None:
    swe, lookup = (SWEEnvironment.__new__(SWEEnvironment), LookupEnvironment.__new__(LookupEnvironment))
    assert sorted(tools_as_trl_finds_them(swe)) == ["bash", "create", "str_replace", "submit", "view"]
    assert sorted(tools_as_trl_finds_them(lookup)) == ["answer", "bash"]
    schema = get_json_schema(SWEEnvironment.bash)["function"]
    assert schema["name"] == "bash" and schema["parameters"]["required"] == ["command"]
    assert get_json_schema(LookupEnvironment.answer)["function"]["parameters"]["required"] == ["answer"]


def test_swe_v0_rollouts_gold_patch_1_unsubmitted_no_op_0(swe_task: Task) -> None:
    row = {"prompt": [{"role": "user", "content": "Fix the issue."}], "task": swe_task.instance_id}
    first, outs, reward = rollout(SWEEnvironment, row, [
        ("create", {"path": GOLD_PATH, "file_text": swe_task.patch}),
        ("bash", {"command": f"git apply {GOLD_PATH} && rm {GOLD_PATH} && echo applied"}), ("submit", {})])
    assert swe_task.problem_statement.strip() in first and "applied" in outs[1] and reward == 1.0
    _, outs, reward = rollout(SWEEnvironment, row, [("bash", {"command": "git status --short | wc -l"})])
    assert outs[0].strip() == "0" and reward == 0.0  # never submitted: graded as it stands (unchanged)


def test_lookup_v0_rollouts_right_code_1_wrong_0_none_0(lookup_task: Any) -> None:
    row = {"prompt": [{"role": "user", "content": ""}], "task": lookup_task.id}
    read = ("bash", {"command": f"cat {lookup_task.key}"})
    first, outs, reward = rollout(LookupEnvironment, row, [read, ("answer", {"answer": lookup_task.answer})])
    assert first == lookup_task.question and outs[0].strip() == lookup_task.answer and reward == 1.0
    wrong = next(w for w in ("python", "project") if w != lookup_task.answer)
    assert rollout(LookupEnvironment, row, [read, ("answer", {"answer": wrong})])[2] == 0.0
    assert rollout(LookupEnvironment, row, [read])[2] == 0.0  # no answer


def test_a_tool_call_after_the_episode_ended_leaves_its_reward(lookup_task: Any) -> None:
    """TRL goes on calling tools while the model emits calls: one after the answer is told the episode is over
    (the env's step gives 0.0 and terminated then) and must not replace the reward the answer earned."""
    row = {"prompt": [], "task": lookup_task.id}
    _, outs, reward = rollout(LookupEnvironment, row, [("answer", {"answer": lookup_task.answer}),
                                                       ("bash", {"command": "true"}), ("answer", {"answer": "x"})])
    assert reward == 1.0, outs




def test_an_instance_is_reused_across_rollouts_and_a_stray_column_is_refused(lookup_task: Any) -> None:
    env = LookupEnvironment()
    try:
        for answer, reward in ((lookup_task.answer, 1.0), ("nothing", 0.0)):
            env.reset(task=lookup_task.id, prompt=[])
            env.answer(answer)
            assert env.get_reward() == reward
        with pytest.raises(TypeError, match=r"unknown columns: \['solution'\]"):
            env.reset(task=lookup_task.id, solution="x")
    finally:
        env._close()


def train_one_step(tmp_path: Any, factory: Any, task: str, scripts: list[list[str]]) -> tuple[list[Any], dict]:
    """One step of TRL's real ``GRPOTrainer`` (a group of ``len(scripts)`` rollouts of ``task``) on CPU."""
    import os

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from . import trl_scripted

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = trl_scripted.tokenizer()
    made: list[Any] = []

    def make() -> Any:
        made.append(factory())
        return made[-1]

    n = len(scripts)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=n, num_generations=n, max_steps=1,
                      max_completion_length=8192, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
                      max_tool_calling_iterations=4, learning_rate=1e-2)
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "Use the tools."}], "task": task}] * n)
    trainer = GRPOTrainer(model=trl_scripted.model(tok, scripts), args=args, train_dataset=rows,
                          processing_class=tok, environment_factory=make)
    try:
        trainer.train()
    finally:
        for env in made:
            env._close()
    (logs, *_) = trainer.state.log_history
    return made, logs


def test_grpo_trainer_step_on_lookup_v0_rewards_from_our_grader(tmp_path: Any, lookup_task: Any) -> None:
    from .trl_scripted import tool_call

    wrong = next(w for w in ("python", "project") if w != lookup_task.answer)
    read = tool_call("bash", command=f"cat {lookup_task.key}")
    made, logs = train_one_step(tmp_path, LookupEnvironment, lookup_task.id,
                                [[read, tool_call("answer", answer=lookup_task.answer), "Done.<|im_end|>"],
                                 [read, tool_call("answer", answer=wrong), "Done.<|im_end|>"]])
    assert len(made) == 2  # TRL's probe instance is pooled and runs one of the two rollouts
    assert sorted(e.get_reward() for e in made) == [0.0, 1.0]
    assert logs["rewards/LookupEnvironment/mean"] == 0.5 and logs["tools/call_frequency"] == 2.0
    assert logs["tools/failure_frequency"] == 0.0 and logs["grad_norm"] > 0


def test_grpo_trainer_step_on_swe_v0_gold_patch_1_no_fix_0(tmp_path: Any, swe_task: Task) -> None:
    from .trl_scripted import tool_call

    made, logs = train_one_step(tmp_path, SWEEnvironment, swe_task.instance_id, [
        [tool_call("create", path=GOLD_PATH, file_text=swe_task.patch),
         tool_call("bash", command=f"git apply {GOLD_PATH} && rm {GOLD_PATH}"), tool_call("submit"), "Done.<|im_end|>"],
        [tool_call("create", path="/tmp/notes", file_text="nothing"), tool_call("bash", command="true"),
         tool_call("submit"), "Done.<|im_end|>"]])
    assert sorted(e.get_reward() for e in made) == [0.0, 1.0]
    assert logs["rewards/SWEEnvironment/mean"] == 0.5 and logs["tools/call_frequency"] == 3.0
    assert logs["tools/failure_frequency"] == 0.0
