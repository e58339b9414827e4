"""A push reaches vLLM and SGLang through their own reload routes, request for request as their released schemas say
(engine_schemas.py: strict models of vLLM 0.33.0's and SGLang 0.5.23's requests, served on 127.0.0.1 by stand-ins
that answer 422 to anything off the schema), records the trainer's step as the engine's weight version and reads it
back; a refusal, an HTTP error or a silent engine is a clear error naming the engine, never a hang."""

import sys
import threading
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from engine_schemas import Engine, sglang_app, vllm_app  # noqa: E402
from rollout_fakes import serve_app  # noqa: E402

from policy.reload import SGLANG_VERSION, VLLM_VERSION, ReloadError, ReloadTimeout, reload  # noqa: E402
from trainer.distributed.sync import Endpoint, SyncError, WeightSync  # noqa: E402


class FolderTrainer:
    """Writes a checkpoint folder (its config.json is what the engines read first) for its step."""

    step_count = 7

    def save_weights(self, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text("{}")
        return path


def vllm_calls(folder: str, version: str, pause: str) -> list:
    return [("POST", "/pause", {"mode": pause}, None),
            ("POST", "/collective_rpc", {}, {"method": "reload_weights", "kwargs": {"weights_path": folder}}),
            ("POST", "/update_weight_version", {}, {"new_version": version}),
            ("POST", "/resume", {}, None),
            ("GET", "/weight_info", {}, None)]


def sglang_calls(folder: str, version: str, abort: bool) -> list:
    return [("POST", "/update_weights_from_disk", {},
             {"model_path": folder, "weight_version": version, "abort_all_requests": abort}),
            ("GET", "/model_info", {}, None)]


@pytest.mark.parametrize("mode", ["drain", "abort"])
def test_a_push_goes_through_each_engine_s_route_and_records_the_step(tmp_path, mode):
    assert (VLLM_VERSION, SGLANG_VERSION) == ("0.33.0", "0.5.23")   # the releases engine_schemas.py was written from
    sg, vl = Engine(key="k"), Engine(key="k")
    with serve_app(sglang_app(sg)) as sg_url, serve_app(vllm_app(vl)) as vl_url:
        sync = WeightSync([Endpoint(sg_url, "sglang", "k"), Endpoint(vl_url, "vllm", "k")], str(tmp_path), mode=mode)
        result = sync.push(FolderTrainer())
        sync.close()
    folder = str(tmp_path / "step-00000007")
    assert sg.calls == sglang_calls(folder, "7", mode == "abort")
    assert vl.calls == vllm_calls(folder, "7", "wait" if mode == "drain" else "abort")
    assert result.versions == {sg_url: 7, vl_url: 7} and result.version == 7
    assert sg.loaded == vl.loaded == [folder] and (sg.version, vl.version) == ("7", "7") and not vl.paused


def test_the_stand_ins_refuse_requests_off_the_schema(tmp_path):
    """The schemas bite: a wrong type, an unknown field, or a kwarg the route cannot carry is a 422."""
    sg, vl = Engine(), Engine()
    with serve_app(sglang_app(sg)) as sg_url, serve_app(vllm_app(vl)) as vl_url:
        for body in ({"model_path": str(tmp_path), "weight_version": 7},
                     {"model_path": str(tmp_path), "version": "7"}, {"path": str(tmp_path)}):
            assert httpx.post(sg_url + "/update_weights_from_disk", json=body).status_code == 422, body
        for body in ({"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path),
                                                             "is_checkpoint_format": "False"}},
                     {"method": "reload_weights", "kwargs": {"path": str(tmp_path)}},
                     {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}, "extra": 1}):
            assert httpx.post(vl_url + "/collective_rpc", json=body).status_code == 422, body
        assert httpx.post(vl_url + "/pause", params={"mode": "drain"}).status_code == 422
        assert httpx.post(vl_url + "/update_weight_version", json={"new_version": 7}).status_code == 422
    assert sg.loaded == vl.loaded == []


def test_refusals_and_http_errors_name_the_engine_and_its_message(tmp_path):
    folder = FolderTrainer().save_weights(tmp_path / "w")
    sg, vl = Engine(refuse="Failed to load: no space left on device"), Engine(refuse="CUDA out of memory")
    with serve_app(sglang_app(sg)) as sg_url, serve_app(vllm_app(vl)) as vl_url, httpx.Client() as client:
        with pytest.raises(ReloadError, match=f"sglang at {sg_url}: POST /update_weights_from_disk answered "
                                              "HTTP 400: Failed to load: no space left on device"):
            reload(client, sg_url, "sglang", str(folder), 3)
        with pytest.raises(ReloadError, match=f"vllm at {vl_url}: POST /collective_rpc answered HTTP 500: "
                                              "CUDA out of memory"):
            reload(client, vl_url, "vllm", str(folder), 3)
        assert not vl.paused and vl.calls[-1][1] == "/resume"    # a failed reload leaves the engine serving
        vl.refuse = ""
        with pytest.raises(ReloadError, match="has no config.json"):   # a file, not a checkpoint folder
            reload(client, vl_url, "vllm", str(tmp_path / "w.safetensors"), 3)
        sg.key = "k"
        with pytest.raises(ReloadError, match="HTTP 401: missing or wrong API key"):
            reload(client, sg_url, "sglang", str(folder), 3, api_key="wrong")
        sg.key, sg.refuse = None, ""
        sync = WeightSync([Endpoint(sg_url, "sglang"), Endpoint(vl_url + "/nowhere", "vllm")], str(tmp_path / "s"),
                          client=client)
        with pytest.raises(SyncError) as e:
            sync.push(FolderTrainer())
    assert f"{vl_url}/nowhere: ReloadError: vllm at {vl_url}/nowhere: POST /pause answered HTTP 404" in str(e.value)
    assert sg_url + ":" not in str(e.value) and sg.version == "7"
    with pytest.raises(ValueError, match="unknown server kind 'tgi'"):
        Endpoint("http://x", "tgi")
    with pytest.raises(ValueError, match="unknown sync mode"):
        reload(httpx.Client(), "http://x", "vllm", str(folder), 1, mode="later")  # type: ignore[arg-type]


def test_an_engine_that_does_not_report_the_pushed_version_is_an_error(tmp_path):
    folder = FolderTrainer().save_weights(tmp_path / "w")
    sg = Engine(ignore_version=True)      # as an SGLang without the weight_version field would
    with serve_app(sglang_app(sg)) as url, httpx.Client() as client:
        with pytest.raises(ReloadError, match=f"sglang at {url} reports weight version 'default' after loading "
                                              "version 5"):
            reload(client, url, "sglang", str(folder), 5)
        sg.ignore_version = False
        assert reload(client, url, "sglang", str(folder), 5) == 5


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_silent_engine_meets_the_deadline(tmp_path, kind):
    folder = FolderTrainer().save_weights(tmp_path / "w")
    engine = Engine(hang=threading.Event())
    app = sglang_app(engine) if kind == "sglang" else vllm_app(engine)
    try:
        with serve_app(app) as url, httpx.Client() as client:
            with pytest.raises(ReloadTimeout, match=f"{kind} at {url}: POST .* gave no answer within the 0.5s "
                                                    "deadline") as e:
                reload(client, url, kind, str(folder), 2, timeout=0.5)
            assert isinstance(e.value, TimeoutError)
            assert not engine.paused       # vLLM: resumed after the reload timed out
            engine.hang.set()
    finally:
        engine.hang.set()
