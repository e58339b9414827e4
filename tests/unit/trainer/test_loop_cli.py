"""`agentenv train`: --dry-run prints the plan and every key and starts nothing; a bad config or an unreachable part
is a clear error before anything starts; a run folder that holds a run is never overwritten."""

from typer.testing import CliRunner

from trainer.cli import app

runner = CliRunner()


def test_dry_run_prints_the_plan_and_the_configuration(tmp_path):
    r = runner.invoke(app, ["--config", "trainer/configs/main.toml", "--quick", "--dry-run",
                            "--set", f'out_dir="{tmp_path}"', "--set", "swe.enabled=false"])
    assert r.exit_code == 0, r.output
    assert "agentenv policy serve --preset k3-mini --ep 2" in r.output
    assert "GRPO: 2 iterations x 2 groups x 2 episodes" in r.output and "synchronous (on-policy)" in r.output
    assert "max_staleness = 0" in r.output and "# 0: synchronous" in r.output
    assert "pre-flight:" in r.output
    assert not (tmp_path / "quick").exists()                         # nothing started, nothing written


def test_existing_endpoint_and_cluster_are_checked_before_anything_starts(tmp_path):
    r = runner.invoke(app, ["--config", "trainer/configs/main.toml", "--quick", "--set", f'out_dir="{tmp_path}"',
                            "--policy-url", "http://127.0.0.1:9", "--ray-address", "127.0.0.1:9",
                            "--set", "ray.workers=1"])
    assert r.exit_code == 1
    assert "pre-flight failed; nothing was started" in r.output
    assert "the policy endpoint http://127.0.0.1:9 is unreachable" in r.output
    assert "the Ray cluster at 127.0.0.1:9 is unreachable" in r.output
    assert not (tmp_path / "quick" / "sft").exists()


def test_bad_configs_are_refused_with_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[rl]\nmax_stalenes = 1\n")
    r = runner.invoke(app, ["--config", str(bad)])
    assert r.exit_code == 2 and "unknown key 'rl.max_stalenes'" in r.output
    r = runner.invoke(app, ["--set", 'env.id="agentenv/Nope-v0"', "--set", f'out_dir="{tmp_path}"', "--dry-run"])
    assert "no env 'agentenv/Nope-v0' is registered" in r.output


def test_a_run_folder_that_holds_a_run_is_kept(tmp_path):
    (tmp_path / "quick").mkdir()
    (tmp_path / "quick" / "metrics.jsonl").write_text("{}\n")
    r = runner.invoke(app, ["--config", "trainer/configs/main.toml", "--quick", "--dry-run",
                            "--set", f'out_dir="{tmp_path}"'])
    assert f"this one goes to {tmp_path / 'quick-2'}" in r.output
    r = runner.invoke(app, ["--quick", "--resume", "--name", "nothing-here", "--set", f'out_dir="{tmp_path}"'])
    assert r.exit_code == 2 and "nothing to resume" in r.output


def test_defaults_lists_every_key():
    r = runner.invoke(app, ["defaults"])
    assert r.exit_code == 0 and "[rl]" in r.output and "partial_rollouts = false" in r.output
