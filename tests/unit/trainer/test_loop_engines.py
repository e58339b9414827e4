"""External engines (vLLM, SGLang): their answers carry no weight version, so the loop stamps its own on each turn
(else every turn is version 0 and, from the second step, the staleness filter drops everything); and a push hands
them a checkpoint folder in the Kimi family's own layout (policy/hf_format.py), the same one ours loads.

The engine is a stand-in on a real loopback HTTP server (uvicorn) speaking vLLM's wire: completions with token ids
and logprobs and no ``weight_version``, and its reload routes (engine_schemas.py) taking a folder."""

import json
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from engine_schemas import Engine, add_vllm_routes, sglang_app  # noqa: E402
from loop_fakes import FORKY, TOK, FakeBackend, FakeTrainer, run_iterations  # noqa: E402
from rollout_fakes import serve_app  # noqa: E402
from trainer_helpers import tiny_cfg  # noqa: E402

from policy.config import from_k3_json  # noqa: E402
from policy.hf_format import read_checkpoint, save_model  # noqa: E402
from policy.model import K3Model  # noqa: E402
from rollout import scripted  # noqa: E402
from rollout.trajectory import read  # noqa: E402
from rollout.workers import RolloutConfig  # noqa: E402
from trainer.distributed.sync import Endpoint, WeightSync  # noqa: E402
from trainer.loop.config import load  # noqa: E402
from trainer.loop.core import Loop  # noqa: E402
from trainer.loop.rollouts import LoopRollout  # noqa: E402
from trainer.metrics import MetricsLog  # noqa: E402

HF_FILES = ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json"]


class WeightTrainer(FakeTrainer):
    """Counts steps and writes a real (tiny) Kimi checkpoint folder whose final norm holds the step count."""

    def __init__(self) -> None:
        super().__init__()
        self.model_cfg = tiny_cfg(vocab_size=TOK._tok.vocab_size, eos_token_id=TOK.eos_id)
        self.state = K3Model(self.model_cfg).state_dict()

    def save_weights(self, path):
        self.state["norm.weight"] = torch.full_like(self.state["norm.weight"], float(self.step_count))
        return save_model(self.state, self.model_cfg, path)


def vllm_like(script):
    """The scripted completions without ``weight_version`` (as vLLM answers), and vLLM's dev-mode reload routes
    (engine_schemas.py: its request schemas enforced)."""
    app = scripted.create_app(script, TOK, model="k3", weight_version=None)
    app.state.engine = Engine()
    return add_vllm_routes(app, app.state.engine)


def two_turns(prompt: str, turn: int) -> str:
    return scripted.tool_call("bash", {"command": "submit" if turn >= 1 else "echo x"})


@pytest.mark.parametrize("start", [0, 5])   # 5: a resumed run, whose pushes carry steps 6, 7, 8
def test_vllm_turns_carry_the_loops_version_and_training_goes_on(tmp_path, start):
    app = vllm_like(two_turns)
    with serve_app(app) as url:
        cfg = load(overrides=[f'out_dir="{tmp_path}"', 'name="t"', f'env.id="{FORKY}"', 'env.train_tasks="ids:a,b"',
                              'env.heldout_tasks="ids:h"', "sft.enabled=false", "swe.enabled=false",
                              "eval.enabled=false", 'progress="off"', "ray.workers=0", f'policy.url="{url}"',
                              'policy.kind="vllm"', "rl.iterations=3", "rl.groups_per_iteration=2",
                              "rl.group_size=2"])
        loop = Loop(cfg)
        loop.trainer, loop.start_weights = WeightTrainer(), None
        loop.trainer.step_count = start
        loop.start_policy()                             # the real pre-flight of the endpoint, and its WeightSync
        backend = FakeBackend()
        rc = RolloutConfig(cfg.env.id, url, backend_factory=lambda: backend, tokenizer_factory=lambda: TOK)
        loop.rollout = LoopRollout(rc, workers=0, out=tmp_path / "trajectories", run_id="unit")
        loop.metrics = MetricsLog(tmp_path / "metrics.jsonl")

        try:
            run_iterations(loop)
        finally:
            loop.sync.close()
    rows = loop.metrics.rows()
    assert [r["staleness/dropped"] for r in rows] == [0, 0, 0]
    assert len(loop.trainer.batches) == 3 and loop.counts["empty_batches"] == 0
    by_iteration = {}
    for t in read(tmp_path / "trajectories"):
        by_iteration.setdefault(t.metadata["iteration"], []).append(t.weight_versions)
    assert by_iteration == {i: [[start + i] * 2] * 4 for i in range(3)}   # each turn: the version loaded when asked
    assert app.state.engine.files == [HF_FILES] * 3              # vLLM got a Hugging Face folder each push
    assert app.state.engine.version == str(start + 3)            # and the last step as its weight version


class Local:
    """An in-process endpoint (``update_weights(path)``), as ours loads: one file."""

    def __init__(self) -> None:
        self.loaded = []

    def update_weights(self, path, mode="drain", timeout=600.0):
        self.loaded.append(path)
        return len(self.loaded)


def test_a_push_to_an_external_engine_writes_a_hugging_face_folder(tmp_path):
    trainer, ours, sg = WeightTrainer(), Local(), Engine()
    with serve_app(sglang_app(sg)) as url:
        sync = WeightSync([Endpoint(url, "sglang"), ours], str(tmp_path / "weights"), keep=1)
        trainer.step_count = 1
        res = sync.push(trainer)
    folder = tmp_path / "weights" / "step-00000001"
    assert res.path == str(folder) and sorted(p.name for p in folder.iterdir()) == HF_FILES
    assert sg.loaded == [str(folder)] and res.versions[url] == 1
    assert ours.loaded == [str(folder)]    # ours loads the same folder
    assert from_k3_json(folder / "config.json") == trainer.model_cfg
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert read_checkpoint(folder).state["norm.weight"].unique().tolist() == [1.0]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size() == TOK._tok.vocab_size
    special = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok.token_to_id(special["eos_token"]) == TOK.eos_id
    trainer.step_count = 2
    sync.endpoints = [ours]
    sync.push(trainer)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step-00000002"]   # no temp folder, kept 1
    assert read_checkpoint(tmp_path / "weights" / "step-00000002").state["norm.weight"].unique().tolist() == [2.0]


def test_ours_alone_gets_the_same_folder(tmp_path):
    trainer, ours = WeightTrainer(), Local()
    sync = WeightSync([ours], str(tmp_path / "weights"))
    trainer.step_count = 3
    res = sync.push(trainer)
    assert res.path == str(tmp_path / "weights" / "step-00000003") and (Path(res.path) / "config.json").is_file()
    assert ours.loaded == [res.path]
