"""``agentenv train``'s configuration: every key documented with a default, the shipped configs valid, unknown keys
and wrong types refused with their name, layers (file, --quick, --set) applied in order, the rendering re-readable."""

import tomllib

import pytest

from trainer.config import (
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
