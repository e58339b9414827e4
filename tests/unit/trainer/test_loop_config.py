"""``agentenv train``'s configuration: every key documented with a default, the shipped configs valid, unknown keys
and wrong types refused with their name, layers (file, --quick, --set) applied in order, the rendering re-readable."""

import tomllib

import pytest

from trainer.loop.config import (
    MAIN_TOML,
    QUICK_TOML,
    ConfigError,
    RunConfig,
    defaults_toml,
    describe,
    load,
    parse_task_spec,
    undocumented,
)


def test_every_key_has_a_documented_default():
    assert undocumented() == []
    text = defaults_toml()
    for section in ("policy", "ray", "env", "sft", "rl", "trainer", "eval", "swe"):
        assert f"[{section}]" in text
    assert "max_staleness = 0" in text and "partial_rollouts = false" in text   # synchronous by default


def test_shipped_configs_load_and_quick_lays_over_main():
    main = load(MAIN_TOML)
    quick = load(MAIN_TOML, quick=True)
    assert main.env.id == quick.env.id and main.policy.ep == 2
    assert quick.name == "quick" and quick.rl.iterations < main.rl.iterations
    assert quick.sft.steps < main.sft.steps
    assert load(QUICK_TOML).name == "quick"


def test_unknown_keys_are_refused_with_their_name(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[rl]\nmax_stalenes = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'rl.max_stalenes' in \[rl\]"):
        load(bad)
    bad.write_text("iterations = 3\n")
    with pytest.raises(ConfigError, match="unknown key 'iterations' in the top level"):
        load(bad)
    bad.write_text("[nope]\nx = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'nope'"):
        load(bad)
    with pytest.raises(ConfigError, match="unknown key 'rl.foo'"):
        load(overrides=["rl.foo=1"])


def test_types_and_ranges_are_checked(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[rl]\niterations = "ten"\n')
    with pytest.raises(ConfigError, match="rl.iterations: expected int"):
        load(bad)
    bad.write_text("[rl]\npartial_rollouts = 1\n")
    with pytest.raises(ConfigError, match="rl.partial_rollouts: expected bool"):
        load(bad)
    bad.write_text("rl = 3\n")
    with pytest.raises(ConfigError, match="rl is a section"):
        load(bad)
    with pytest.raises(ConfigError, match="max_staleness must be >= 0"):
        load(overrides=["rl.max_staleness=-1"])
    with pytest.raises(ConfigError, match="trainer.ep must divide"):
        load(overrides=["trainer.world=3", "trainer.ep=2"])
    with pytest.raises(ConfigError, match="seeds:A-B"):
        load(overrides=['env.train_tasks="seeds:a-b"'])
    assert load(overrides=["rl.lr=1"]).rl.lr == 1.0          # an int where a float goes is fine


def test_layers_apply_in_order(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('name = "x"\n[rl]\niterations = 5\nmax_staleness = 1\n[env]\nkwargs = {levels = [1]}\n')
    cfg = load(f, overrides=["rl.iterations=7", 'policy.url="http://h:1"', "name=plain-word"])
    assert (cfg.rl.iterations, cfg.rl.max_staleness, cfg.policy.url, cfg.name) == (7, 1, "http://h:1", "plain-word")
    assert cfg.env.kwargs == {"levels": [1]}
    assert cfg.run_dir.name == "plain-word"


def test_describe_round_trips(tmp_path):
    cfg = load(MAIN_TOML, quick=True, overrides=["rl.max_staleness=2", "swe.task_ids=['a', 'b']"])
    text = describe(cfg)
    assert "[default: 0]" in text                                # what differs from the default says so
    f = tmp_path / "again.toml"
    f.write_text(text)
    assert load(f) == cfg
    assert tomllib.loads(describe(RunConfig(), comments=False))["rl"]["max_staleness"] == 0


def test_task_specs():
    assert parse_task_spec("seeds:3-5") == ("seeds", range(3, 6))
    assert parse_task_spec("ids:a, b") == ("ids", ["a", "b"])
    kind, (ref, kw) = parse_task_spec("py:envs.lookup_env:task_ids split=heldout n=8 levels=[1,2]")
    assert (kind, ref, kw) == ("py", "envs.lookup_env:task_ids", {"split": "heldout", "n": 8, "levels": [1, 2]})
    assert parse_task_spec("tasks.jsonl") == ("file", "tasks.jsonl")
    for bad in ("seeds:9-1", "ids:", "py:nofunction", "py:m:f noequals"):
        with pytest.raises(ConfigError):
            parse_task_spec(bad)


def test_switches_that_the_trainer_cannot_honour_are_refused():
    """env.top_p < 1: the trainer scores under the full distribution, so the ratios would be biased: refused with
    the reason. dual_clip must be > 1 (or 0), router_bias_rate >= 0, mini_batches >= 1."""
    with pytest.raises(ConfigError, match="top_p.*full temperature-scaled distribution"):
        load(overrides=["env.top_p=0.9"])
    with pytest.raises(ConfigError, match="rl.dual_clip must be > 1"):
        load(overrides=["rl.dual_clip=0.5"])
    with pytest.raises(ConfigError, match="router_bias_rate"):
        load(overrides=["rl.router_bias_rate=-1"])
    with pytest.raises(ConfigError, match="mini_batches"):
        load(overrides=["rl.mini_batches=0"])
    cfg = load(overrides=["rl.dual_clip=0"])
    assert cfg.rl.dual_clip == 0.0 and RunConfig().rl.dual_clip == 3.0


def test_the_mini_batches_doc_says_one_means_ratio_one():
    from dataclasses import fields

    from trainer.loop.config import RLConfig

    text = next(f.metadata["doc"] for f in fields(RLConfig) if f.name == "mini_batches")
    assert "ratio is exactly 1" in text and "REINFORCE" in text
    assert "REINFORCE" in MAIN_TOML.read_text()


def test_routing_replay_is_refused_for_endpoints_that_cannot_return_routing(tmp_path):
    from trainer.loop.services import PreflightError, preflight

    for kind in ("vllm", "sglang"):
        cfg = load(overrides=[f"policy.kind={kind}", "policy.url=http://127.0.0.1:9", "rl.routing_replay=true",
                              f'out_dir="{tmp_path}"', "swe.enabled=false", "sft.enabled=false"])
        with pytest.raises(PreflightError, match=f"rl.routing_replay.*policy.kind {kind} cannot"):
            preflight(cfg, resume=False, build=False)
    ok = load(overrides=["policy.kind=vllm", "policy.url=http://127.0.0.1:9", f'out_dir="{tmp_path}"',
                         "swe.enabled=false", "sft.enabled=false"])
    with pytest.raises(PreflightError) as e:          # the endpoint is down, but replay is not the complaint
        preflight(ok, resume=False, build=False)
    assert "routing_replay" not in str(e.value)


def test_the_warm_start_takes_the_cores_no_other_process_keeps_busy():
    import multiprocessing
    import os

    from trainer.sft import idle_cores

    cores = len(os.sched_getaffinity(0))
    assert 1 <= idle_cores(0.2) <= cores
    # a process that keeps a core busy takes that core (its own time is not counted against the idle ones)
    spinner = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    spinner.start()
    try:
        while not _started(spinner):
            pass
        assert idle_cores(0.5) <= max(1, cores - 1)
    finally:
        spinner.kill()
        spinner.join()
    with pytest.raises(ConfigError, match="sft.threads"):
        load(overrides=["sft.threads=-1"])


def _spin() -> None:
    while True:
        pass


def _started(p) -> bool:
    """The spinner has run on a CPU (its utime has moved)."""
    from pathlib import Path
    try:
        return int(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[11]) > 0
    except (OSError, IndexError):
        return False
