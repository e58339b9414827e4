"""The main job's pre-flight on a machine without a task image its config needs (as on a fresh clone, where only the
test suite used to build them): a dry run names the missing image, a real run builds it and goes on."""

from __future__ import annotations

import subprocess

import pytest

from envs.images import image_exists
from trainer.loop.config import RunConfig
from trainer.loop.services import PreflightError, preflight, swe_task_records


def test_the_preflight_builds_a_missing_swe_task_image(tmp_path):
    cfg = RunConfig()
    cfg.out_dir = str(tmp_path)
    cfg.swe.groups = 1
    image = swe_task_records(cfg)[0]["image"]
    subprocess.run(["docker", "image", "rm", "-f", image], capture_output=True, check=False, timeout=120)
    assert not image_exists(image)
    with pytest.raises(PreflightError, match="is missing"):
        preflight(cfg, resume=False, build=False)
    assert not image_exists(image)  # the dry run's pre-flight only reports
    checked = preflight(cfg, resume=False)
    assert "swe tasks and image" in checked
    assert image_exists(image)
