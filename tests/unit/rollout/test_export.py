"""``agentenv rollout export``: hand-written multi-turn shards out as JSONL / parquet in each schema, read back with
json, pyarrow, ``datasets`` and TRL's own label building (and verl's ``DataProto`` where verl imports)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rollout import export
from rollout import trajectory as tj
from rollout.agent import LocalTokenizer
from rollout.cli import app
from rollout.trajectory import Trajectory, Turn

runner = CliRunner()
PROMPT = [1, 2, 3, 4]
# response: turn 1 (2 generated), tool output (3), turn 2 (3 generated), a last tool output the policy never read (1)
RESPONSE = [10, 11, 7, 8, 9, 12, 13, 14, 5]
MASK = [1, 1, 0, 0, 0, 1, 1, 1, 0]
LOGPROBS = [-0.5, -0.25, 0.0, 0.0, 0.0, -0.125, -1.5, -2.0, 0.0]


def episode(reward: float | None, group: str = "g1", index: int = 0, finish: str = "submitted") -> Trajectory:
    t = Trajectory(task_id="calc-1", env_id="agentenv/Tool-v0", group_id=group, group_index=index, seed=7,
                   grade={"passed": reward == 1.0}, metadata={"reset_s": 0.5})
    t.append(PROMPT, generated=False)
    t.prompt_len = len(PROMPT)
    t.turns.append(Turn(start=len(t.token_ids), generated=2, weight_version=3, tool_calls=1))
    t.append([10, 11], generated=True, logprobs=[-0.5, -0.25])
    t.append([7, 8, 9], generated=False)
    t.turns.append(Turn(start=len(t.token_ids), generated=3, weight_version=4))
    t.append([12, 13, 14], generated=True, logprobs=[-0.125, -1.5, -2.0])
    t.append([5], generated=False)
    t.reward, t.finish_reason, t.tool_calls = reward, finish, 1
    return t


@pytest.fixture
def run(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    tj.write(folder, [episode(1.0), episode(0.0, index=1), episode(None, index=2, finish="env_error"),
                      episode(0.5, group="g2")], records_per_shard=2)
    return folder


def flat(output: str) -> str:
    """The output without rich's line wrapping."""
    return " ".join(output.split())


def cli(*args: str) -> str:
    r = runner.invoke(app, ["export", *args])
    assert r.exit_code == 0, r.output
    return flat(r.output)


def test_neutral_jsonl_keeps_ids_mask_logprobs_and_rewards_exactly(run, tmp_path):
    out = tmp_path / "out.jsonl"
    output = cli(str(run), "--out", str(out))
    assert "3 trajectories" in output and "1 infrastructure-error episodes left out" in output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 0.5]
    for r in rows:
        assert r["prompt_ids"] == PROMPT and r["response_ids"] == RESPONSE
        assert r["loss_mask"] == MASK and r["logprobs"] == LOGPROBS
        assert r["weight_versions"] == [3, 4] and r["finish_reason"] == "submitted" and r["task_id"] == "calc-1"
    assert [r["group_id"] for r in rows] == ["g1", "g1", "g2"] and rows[0]["grade"] == {"passed": True}


def test_errors_are_kept_on_request_with_a_null_reward(run, tmp_path):
    out = tmp_path / "all.parquet"
    cli(str(run), "--out", str(out), "--format", "parquet", "--schema", "verl", "--keep-errors")
    t = pq.read_table(out).to_pylist()
    assert [r["reward"] for r in t] == [1.0, 0.0, None, 0.5]
    assert t[2]["token_level_rewards"] is None and t[2]["finish_reason"] == "env_error"


def test_verl_columns(run, tmp_path):
    out = tmp_path / "verl.parquet"
    cli(str(run), "--out", str(out), "--format", "parquet", "--schema", "verl")
    rows = pq.read_table(out).to_pylist()
    r = rows[0]
    assert r["prompts"] == PROMPT and r["responses"] == RESPONSE and r["response_mask"] == MASK
    assert r["input_ids"] == PROMPT + RESPONSE and r["attention_mask"] == [1] * 13
    assert r["rollout_log_probs"] == LOGPROBS
    # the reward sits on the last generated token (index 7), not on the trailing tool output
    assert r["token_level_rewards"] == [0.0] * 7 + [1.0, 0.0] and r["token_level_scores"] == r["token_level_rewards"]
    assert [x["uid"] for x in rows] == ["g1", "g1", "g2"] and r["data_source"] == "agentenv/Tool-v0"
    assert json.loads(r["metadata"]) == {"reset_s": 0.5}


def test_slime_columns_match_its_sample(run, tmp_path):
    out = tmp_path / "slime.jsonl"
    cli(str(run), "--out", str(out), "--schema", "slime")
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    r = rows[0]
    assert r["tokens"] == PROMPT + RESPONSE and r["response_length"] == len(RESPONSE)
    assert r["loss_mask"] == MASK and r["rollout_log_probs"] == LOGPROBS and r["reward"] == 1.0
    assert r["status"] == "completed" and r["weight_versions"] == ["3", "4"]
    assert [x["group_index"] for x in rows] == [0, 0, 1] and [x["index"] for x in rows] == [0, 1, 2]
    assert r["metadata"]["task_id"] == "calc-1" and r["metadata"]["reset_s"] == 0.5
    # slime reads the response as tokens[-response_length:] with loss_mask / logprobs of that length
    assert r["tokens"][-r["response_length"]:] == RESPONSE and len(r["rollout_log_probs"]) == r["response_length"]


def test_trl_reads_the_parquet_and_masks_the_tool_outputs(run, tmp_path):
    """``datasets.load_dataset("parquet")``, then TRL's own SFT preparation: labels are -100 on the prompt and the
    tool outputs, the token id on every generated token."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    out = tmp_path / "trl.parquet"
    cli(str(run), "--out", str(out), "--format", "parquet", "--schema", "trl")
    ds = datasets.load_dataset("parquet", data_files=str(out), split="train")
    assert ds[0]["input_ids"] == PROMPT + RESPONSE and ds[0]["completion_mask"] == [0] * 4 + MASK
    assert ds["reward"] == [1.0, 0.0, 0.5]
    fake = types.SimpleNamespace(completion_only_loss=True, chat_template=None)
    args = SFTConfig(output_dir=str(tmp_path / "trl-out"), max_length=None, report_to=[], use_cpu=True,
                     bf16=False)
    prepared = SFTTrainer._prepare_dataset(fake, ds, None, args, False, None, "train")  # type: ignore[arg-type]
    labels = prepared[0]["labels"]
    assert labels == [-100] * 4 + [t if m else -100 for t, m in zip(RESPONSE, MASK, strict=True)]


def test_text_columns_decode_with_the_runs_tokenizer(tmp_path):
    tok = LocalTokenizer()
    t = Trajectory(task_id="t", env_id="agentenv/Tool-v0")
    prompt, answer, tool = tok.encode_text("What is 2 + 2?"), tok.encode_text("It is 4."), tok.encode_text("tool says 4")
    t.append(prompt, generated=False)
    t.prompt_len = len(prompt)
    t.turns.append(Turn(start=len(prompt), generated=len(answer), weight_version=0))
    t.append(answer, generated=True, logprobs=[-0.1] * len(answer))
    t.append(tool, generated=False)
    t.reward = 1.0
    tj.write(tmp_path / "run", [t])
    out = tmp_path / "text.jsonl"
    cli(str(tmp_path / "run"), "--out", str(out), "--schema", "trl", "--text")
    r = json.loads(out.read_text())
    assert r["prompt"] == tok.decode(prompt) and r["completion"] == tok.decode(answer + tool)
    assert "What is 2 + 2?" in r["prompt"] and "It is 4." in r["completion"]


def test_a_train_run_is_read_from_its_trajectories_folder(tmp_path):
    tj.write(tmp_path / "train" / "trajectories", [episode(1.0)])
    out = tmp_path / "t.jsonl"
    cli(str(tmp_path / "train"), "--out", str(out))
    assert json.loads(out.read_text())["response_ids"] == RESPONSE


def test_the_mask_comes_from_the_turns_and_must_match(tmp_path):
    t = episode(1.0)
    t.turns[1].start += 1   # same count of generated tokens, at the wrong place
    with pytest.raises(export.ExportError, match="do not match its loss_mask"):
        export.split(t)


def test_an_empty_run_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    r = runner.invoke(app, ["export", str(tmp_path / "empty"), "--out", str(tmp_path / "x.parquet"),
                            "--format", "parquet"])
    assert r.exit_code == 1 and "holds no trajectory to export" in flat(r.output)
    assert not (tmp_path / "x.parquet").exists()
    tj.write(tmp_path / "errors", [episode(None, finish="policy_error")])
    r = runner.invoke(app, ["export", str(tmp_path / "errors"), "--out", str(tmp_path / "y.jsonl")])
    assert r.exit_code == 1 and "--keep-errors" in flat(r.output) and not (tmp_path / "y.jsonl").exists()
    r = runner.invoke(app, ["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "z.jsonl")])
    assert r.exit_code == 1 and "no run folder" in flat(r.output)


@pytest.mark.parametrize(("option", "value"), [("--format", "csv"), ("--schema", "openrlhf")])
def test_a_bad_format_or_schema_is_refused(run, tmp_path, option, value):
    r = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "o"), option, value])
    assert r.exit_code == 2 and "Invalid value" in flat(r.output) and value in r.output
    assert not (tmp_path / "o").exists()


def test_verl_dataproto_loads_the_parquet(run, tmp_path):
    """Through verl's own ``DataProto`` (skipped where verl does not import: it is not a project dependency)."""
    pytest.importorskip("verl")
    import numpy as np
    import torch
    from torch.nn.utils.rnn import pad_sequence
    from verl import DataProto

    out = tmp_path / "verl.parquet"
    cli(str(run), "--out", str(out), "--format", "parquet", "--schema", "verl")
    rows = pq.read_table(out).to_pylist()

    def pad(key, dtype, left=False):
        seqs = [torch.tensor(r[key][::-1] if left else r[key], dtype=dtype) for r in rows]
        padded = pad_sequence(seqs, batch_first=True)
        return padded.flip(1) if left else padded

    batch = DataProto.from_single_dict({
        "prompts": pad("prompts", torch.long, left=True), "responses": pad("responses", torch.long),
        "response_mask": pad("response_mask", torch.long), "rollout_log_probs": pad("rollout_log_probs", torch.float),
        "token_level_rewards": pad("token_level_rewards", torch.float),
        "uid": np.array([r["uid"] for r in rows], dtype=object)})
    assert len(batch) == 3 and batch.batch["responses"].shape == (3, len(RESPONSE))
    assert batch.batch["response_mask"][0].tolist() == MASK
    assert batch.batch["token_level_rewards"].sum(-1).tolist() == [1.0, 0.0, 0.5]
    assert list(batch.non_tensor_batch["uid"]) == ["g1", "g1", "g2"]
