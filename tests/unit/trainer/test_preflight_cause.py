"""The main job's pre-flight names what failed: only the Docker engine's own connection errors read as "Docker
is unreachable"; anything else is reported as itself, its type and message (a fresh Debian's Python 3.11.2 once
failed an archive call that the pre-flight blamed on Docker)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.loop.config import RunConfig
from trainer.loop.services import _check_swe


def test_a_check_that_breaks_is_reported_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(tag: str) -> bool:
        raise TypeError("TarFile.extractall() got an unexpected keyword argument 'filter'")

    monkeypatch.setattr("envs.images.image_exists", broken)
    cfg = RunConfig()
    cfg.swe.groups = 1
    problem = _check_swe(cfg, build=False)
    assert problem is not None and "Docker is unreachable" not in problem
    assert "TypeError: TarFile.extractall() got an unexpected keyword argument 'filter'" in problem


def test_an_engine_that_does_not_answer_is_docker_unreachable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from agentenv.host import images

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")  # the real SDK, against no engine
    images.docker_client.cache_clear()
    try:
        cfg = RunConfig()
        cfg.swe.groups = 1
        problem = _check_swe(cfg, build=False)
    finally:
        images.docker_client.cache_clear()
    assert problem is not None and problem.startswith("Docker is unreachable"), problem
