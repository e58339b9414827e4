"""OpenRLHF 0.11.2: SWE-v0 and Lookup-v0 episodes through OpenRLHF's own ``MultiTurnAgentExecutor.execute`` on
real sandboxes: the agent file loaded as ``--agent_func_path`` loads it (``AgentExecutor`` from a ``.py`` file),
a scripted engine with vLLM's ``generate(prompt_token_ids, sampling_params, multi_modal_data=)`` answering K3
tool-call text encoded with the project's tokenizer; our grader's reward, and the tool outputs outside every
action range (OpenRLHF trains only those).

OpenRLHF does not install beside this project's pins (docs/integrations/openrlhf.md), so this skips without it.
To run it, a side venv with ``pip install --no-deps openrlhf==0.11.2 pylatexenc`` on the path:

    PYTHONPATH=$PWD:/tmp/orlhfenv/lib/python3.11/site-packages .venv/bin/python -m pytest \
        tests/integration/frameworks/test_openrlhf.py
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("openrlhf.utils.agent")
import torch  # noqa: E402
from openrlhf.utils.agent import AgentExecutorBase  # noqa: E402

from envs.task import Task  # noqa: E402
from policy import chat  # noqa: E402
from policy.tokenizer import load_tokenizer  # noqa: E402

from .conftest import call, gold_actions  # noqa: E402

pytestmark = pytest.mark.integration
RETURN = "## Return of "


class HFTokenizer:
    """The project's tokenizer called as OpenRLHF calls a Hugging Face one."""

    def __init__(self) -> None:
        self.tok = load_tokenizer()

    def __call__(self, text: str, add_special_tokens: bool = False, return_tensors: str = "pt") -> dict:
        return {"input_ids": torch.tensor([self.tok.encode(text)])}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids)


class ScriptedEngine:
    """vLLM's ``generate`` shape: the script's turn (counted by tool returns in the prompt), ending the turn."""

    def __init__(self, tok: Any, script: list[str]) -> None:
        self.tok, self.script = tok, script

    async def generate(self, prompt_token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None) -> Any:
        ids = self.tok.encode_assistant(self.script[self.tok.decode(prompt_token_ids).count(RETURN)]) + [self.tok.eos_id]
        text = self.tok.decode(ids)
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, text=text, finish_reason="stop", logprobs=None)])


def executor(tmp_path: Path, name: str) -> AgentExecutorBase:
    """The agent file a user writes, loaded the way OpenRLHF's ``_load_agent_executor`` loads it."""
    path = tmp_path / "agent.py"
    path.write_text(f"from envs.frameworks.openrlhf import {name} as AgentExecutor\n")
    spec = importlib.util.spec_from_file_location("agent_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert issubclass(module.AgentExecutor, AgentExecutorBase)
    return module.AgentExecutor()


def episode(tmp_path: Path, name: str, task: str, script: list[str]) -> tuple[dict, Any]:
    hf = HFTokenizer()
    params = SimpleNamespace(max_tokens=None, logprobs=None)
    out = asyncio.run(executor(tmp_path, name).execute("", task, params, 32768, hf, ScriptedEngine(hf.tok, script)))
    tokens = out["observation_tokens"]
    acted = "".join(hf.tok.decode(tokens[a:b]) for a, b in out["action_ranges"])
    assert acted == "".join(s + chat.IM_END for s in script) and RETURN not in acted
    assert hf.tok.decode(tokens).count(RETURN) == len(script) - 1  # every tool output outside the ranges
    return out, hf.tok


def test_swe_v0_agent_gold_patch_1_no_fix_0(tmp_path: Path, swe_task: Task) -> None:
    out, tok = episode(tmp_path, "SWEAgentExecutor", swe_task.instance_id, gold_actions(swe_task))
    assert swe_task.problem_statement.strip() in tok.decode(out["observation_tokens"])
    assert "applied" in tok.decode(out["observation_tokens"])
    assert out["reward"] == 1.0 and out["scores"].item() == 1.0
    out, _ = episode(tmp_path, "SWEAgentExecutor", swe_task.instance_id, [call("bash", command="true"), call("submit")])
    assert out["reward"] == 0.0


def test_lookup_v0_agent_right_code_1_wrong_0(tmp_path: Path, lookup_task: Any) -> None:
    read = call("bash", command=f"cat {lookup_task.key}")
    out, tok = episode(tmp_path, "LookupAgentExecutor", lookup_task.id, [read, call("answer", answer=lookup_task.answer)])
    assert lookup_task.question in tok.decode(out["observation_tokens"]) and out["reward"] == 1.0
    wrong = next(w for w in ("python", "project") if w != lookup_task.answer)
    out, _ = episode(tmp_path, "LookupAgentExecutor", lookup_task.id, [read, call("answer", answer=wrong)])
    assert out["reward"] == 0.0


def test_an_instance_takes_no_arguments() -> None:
    from envs.frameworks.openrlhf import LookupAgentInstance

    with pytest.raises(TypeError, match="takes no arguments"):
        LookupAgentInstance(max_steps=3)
