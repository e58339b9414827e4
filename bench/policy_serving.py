"""Benchmark the policy engine's prefix-state reuse: multi-turn episodes and n-sample groups, with and without it.

An episode is what the rollout loop sends: a system prompt with tool declarations and a task, then ``--turns``
turns, each generating ``--gen`` tokens, the answer appended verbatim as token ids and an observation
(``--obs`` tokens of tool output) tokenised and appended. With reuse, each turn starts from the state the last
one left (KDA's recurrent state + the MLA latents) and prefills only the new tokens; without it
(``prefix_cache_bytes=0``) every turn prefills the whole conversation. A group asks for ``--group`` samples of
one prompt in one request: prefilled once and forked, or prefilled once per sample.

Figures (``bench/results/policy_serving.json``): time per episode and per group request under ``episode.reuse``
/ ``episode.no_reuse`` and ``group.reuse`` / ``group.no_reuse``, each with the prefill tokens computed and saved
per run; ratios no-reuse / reuse. Both engines run the same greedy tokens (checked, not timed).
Run: ``python -m bench.policy_serving [--quick] [--ep 2]``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from bench.harness import Report, Row, Timer, add_output_arg, console, print_table
from policy.chat import GENERATION_PIECES, IM_END, IM_MIDDLE, IM_SYSTEM, Control
from policy.config import k3_mini
from policy.engine import Engine, SamplingParams
from policy.tokenizer import load_tokenizer

TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
    for n, d in (("bash", "Run a shell command in the repository"), ("view", "Show a file with line numbers"),
                 ("str_replace", "Replace a unique string in a file"), ("submit", "Submit the change"))]


def episode_prompt(tok: Any, i: int) -> list[int]:
    task = (f"Task {i}: the test tests/test_utils.py::test_merge_{i} fails after a refactor of utils.merge. "
            "Find the cause, fix it without changing the tests, and run the test suite before submitting.")
    return tok.encode_chat([{"role": "system", "content": "You are a coding agent working in /testbed."},
                            {"role": "user", "content": task}], TOOLS)


def observation(tok: Any, turn: int, n_tokens: int) -> list[int]:
    text = (f"## Return of functions.bash:{turn}\n"
            + " ".join(f"tests/test_utils.py::test_case_{turn}_{k} PASSED" for k in range(64)))
    ids = tok.encode_pieces([Control(IM_END), Control(IM_SYSTEM), "tool", Control(IM_MIDDLE), text])[:n_tokens]
    return ids + tok.encode_pieces([Control(IM_END), *GENERATION_PIECES])


def run_episode(engine: Engine, tok: Any, i: int, turns: int, gen: int, obs: int) -> list[list[int]]:
    prompt, outs = episode_prompt(tok, i), []
    for t in range(turns):
        s = engine.generate([prompt], SamplingParams(max_tokens=gen, temperature=0))[0]
        outs.append(s.output_ids)
        prompt = prompt + s.output_ids + observation(tok, t, obs)
    return outs


def measure(report: Report, engine: Engine, label: str, args: argparse.Namespace, tok: Any) -> dict[str, Any]:
    ep, grp = report.result(f"episode.{label}"), report.result(f"group.{label}")
    ep.note = f"{args.turns} turns x {args.gen} tokens, {args.obs}-token observations"
    grp.note = f"one request for {args.group} samples of a {len(episode_prompt(tok, 0))}-token prompt, {args.gen} tokens each"
    outputs: dict[str, Any] = {"episodes": [], "groups": []}
    for name, r, runs in (("episodes", ep, args.episodes), ("groups", grp, args.groups)):
        computed, saved = [], []
        for i in range(runs):
            before = engine.metrics()
            with Timer() as t:
                if name == "episodes":
                    outputs[name].append(run_episode(engine, tok, i, args.turns, args.gen, args.obs))
                else:
                    prompt = episode_prompt(tok, 2000 + i)
                    seqs = [engine.submit(prompt, SamplingParams(max_tokens=args.gen, temperature=1.0, seed=k))
                            for k in range(args.group)]
                    for s in seqs:
                        s.done.wait()
                    outputs[name].append([s.output_ids for s in seqs])
            after = engine.metrics()
            r.add(t.s)
            computed.append(after["prefill_tokens"] - before["prefill_tokens"])
            saved.append(after["prefill_tokens_saved"] - before["prefill_tokens_saved"])
        r.fields.update(prefill_tokens_computed_per_run=sum(computed) / len(computed),
                        prefill_tokens_saved_per_run=sum(saved) / len(saved))
    return outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--gen", type=int, default=16, help="tokens generated per turn / per sample")
    ap.add_argument("--obs", type=int, default=48, help="observation tokens per turn")
    ap.add_argument("--group", type=int, default=8, help="samples per group request")
    ap.add_argument("--episodes", type=int, default=3)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 episodes of 4 turns, 2 groups")
    add_output_arg(ap, "policy_serving")
    args = ap.parse_args(argv)
    if args.quick:
        args.turns, args.episodes, args.groups = 4, 2, 2
    report = Report("policy_serving", args)
    report.machine.update(torch=torch.__version__, threads=torch.get_num_threads())
    tok = load_tokenizer()
    cfg = k3_mini(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, bos_token_id=tok.bos_id, pad_token_id=tok.pad_id)
    outputs = {}
    for label, budget in (("reuse", 256 << 20), ("no_reuse", 0)):
        console.log(f"engine with {'prefix reuse' if budget else 'no prefix reuse'} (EP={args.ep})")
        engine = Engine(cfg, tok, ep_size=args.ep, seed=0, max_context=4096, prefix_cache_bytes=budget)
        try:
            run_episode(engine, tok, 99, 1, 2, 8)  # warm-up
            outputs[label] = measure(report, engine, label, args, tok)
            report.info[f"metrics_{label}"] = {k: v for k, v in engine.metrics().items() if "expert" not in k}
        finally:
            engine.close()
    same = outputs["reuse"]["episodes"] == outputs["no_reuse"]["episodes"]
    report.info["greedy_episodes_identical"] = same
    if not same:
        report.notes.append("greedy episodes differ between reuse and no reuse")
    for what in ("episode", "group"):
        report.add_ratio(f"{what} no_reuse/reuse", f"{what}.no_reuse", f"{what}.reuse")
    rows = []
    for key, r in report.results.items():
        rows.append(Row(key, [r], cells={"prefill computed / saved per run":
                                         f"{r.fields['prefill_tokens_computed_per_run']:.0f} / "
                                         f"{r.fields['prefill_tokens_saved_per_run']:.0f}"}))
    print_table(f"k3-mini prefix reuse, EP={args.ep}, ms per run", rows)
    for name, rt in report.ratios.items():
        console.print(f"{name} (median time ratio): {rt['text']}", highlight=False)
    console.print(f"greedy episodes identical with and without reuse: {same}", highlight=False)
    report.write(args.output)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
