"""verl 0.9.1: SWE-v0 and Lookup-v0 episodes through verl's agent-loop interface on real sandboxes: the loop made
by ``hydra.utils.instantiate`` from verl's registry (as ``AgentLoopWorker._run_agent_loop`` does), ``run``
driven by a scripted server manager with ``AsyncLLMServerManager.generate``'s signature (token ids in, K3 tool-call
text encoded with the project's tokenizer out), then ``AgentLoopOutput.as_dict()``: our grader's reward in
``rm_scores``, ``response_mask`` 0 over every tool output.

verl does not install beside this project's pins (see docs/integrations/verl.md), so this skips without it. To
run it, put a side venv's site-packages holding verl (``pip install --no-deps verl==0.9.1 tensordict pyvers
codetiming hydra-core orjson cachetools antlr4-python3-runtime==4.9.3``) on the path:

    PYTHONPATH=$PWD:/tmp/verlenv/lib/python3.11/site-packages .venv/bin/python -m pytest \
        tests/integration/frameworks/test_verl.py
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("verl.experimental.agent_loop")
import hydra  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopOutput,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

import envs.frameworks.verl  # noqa: E402,F401  (registers agentenv_swe and agentenv_lookup)
from envs.task import Task  # noqa: E402
from policy import chat  # noqa: E402
from policy.tokenizer import load_tokenizer  # noqa: E402

from .conftest import call, gold_actions  # noqa: E402

pytestmark = pytest.mark.integration
RETURN = "## Return of "  # what starts every K3 tool message's body


class ScriptedServerManager:
    """``generate`` as ``AsyncLLMServerManager`` has it; answers the script's turn (counted by tool returns)."""

    def __init__(self, tok: Any, script: list[str]) -> None:
        self.tok, self.script, self.request_ids = tok, script, set()

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, **kwargs: Any) -> TokenOutput:
        self.request_ids.add(request_id)
        turn = self.tok.decode(prompt_ids).count(RETURN)
        ids = self.tok.encode_assistant(self.script[turn]) + [self.tok.eos_id]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed")


def episode(agent_name: str, task: Any, script: list[str]) -> tuple[AgentLoopOutput, dict[str, Any], Any]:
    tok = load_tokenizer()
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 16384, "response_length": 16384}},
                               "data": {}})
    server = ScriptedServerManager(tok, script)

    async def go() -> AgentLoopOutput:
        loop = hydra.utils.instantiate(config=_agent_loop_registry[agent_name], trainer_config=DictConfigWrap(config),
                                       server_manager=server, tokenizer=tok, processor=None, hf_model_type=None,
                                       dataset_cls=None, data_config=DictConfigWrap(config.data),
                                       tools=ToolListWrap([]))
        return await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "system", "content": "You are an agent."}],
                              extra_info={"task": task}, agent_name=agent_name)

    out = asyncio.run(go())
    assert len(server.request_ids) == 1  # one sticky request id for the whole episode
    return out, out.as_dict(), tok


def check_mask(out: AgentLoopOutput, tok: Any, script: list[str]) -> None:
    """Generated tokens (each script turn) are 1; every tool message (and nothing else) is 0."""
    ids, mask = out.response_ids, out.response_mask
    gen = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert gen == "".join(s + chat.IM_END for s in script)
    masked = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert masked.count(RETURN) == len(script) - 1 and RETURN not in gen


def test_swe_v0_agent_loop_gold_patch_1_no_fix_0(swe_task: Task) -> None:
    script = gold_actions(swe_task)
    out, d, tok = episode("agentenv_swe", swe_task.instance_id, script)
    assert swe_task.problem_statement.strip() in tok.decode(out.prompt_ids)
    assert "applied" in tok.decode(out.response_ids)  # the second turn's tool output, from the sandbox
    check_mask(out, tok, script)
    assert out.reward_score == 1.0 and d["rm_scores"][-1] == 1.0 and d["rm_scores"][:-1].sum() == 0
    assert d["rollout_log_probs"].shape == d["responses"].shape
    no_fix = [call("bash", command="git status --short | wc -l"), call("submit")]
    out, d, tok = episode("agentenv_swe", swe_task.instance_id, no_fix)
    check_mask(out, tok, no_fix)
    assert out.reward_score == 0.0 and d["rm_scores"].sum() == 0


def test_lookup_v0_agent_loop_right_code_1_wrong_0(lookup_task: Any) -> None:
    read = call("bash", command=f"cat {lookup_task.key}")
    right = [read, call("answer", answer=lookup_task.answer)]
    out, d, tok = episode("agentenv_lookup", lookup_task.id, right)
    assert lookup_task.question in tok.decode(out.prompt_ids)
    check_mask(out, tok, right)
    masked = tok.decode([t for t, m in zip(out.response_ids, out.response_mask, strict=True) if not m])
    assert lookup_task.answer in masked  # read in the sandbox, and masked out
    assert out.reward_score == 1.0 and d["rm_scores"][-1] == 1.0
    wrong = next(w for w in ("python", "project") if w != lookup_task.answer)
    out, _, _ = episode("agentenv_lookup", lookup_task.id, [read, call("answer", answer=wrong)])
    assert out.reward_score == 0.0


def test_multimodal_inputs_are_refused() -> None:
    loop = object.__new__(envs.frameworks.verl.LookupAgentLoop)  # refused before anything is made
    with pytest.raises(ValueError, match="multimodal inputs are not supported"):
        asyncio.run(loop.run({}, images=["x"]))
