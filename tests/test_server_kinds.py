"""The server engine speaking vLLM and SGLang, against response shapes recorded from their documented schemas
(tests/fixtures/server_shapes.json; neither server runs here): requests, the abort-and-continue loop, version
tags, the weight-update sequence, retries and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from vcpo.rollout.server import ServerRolloutEngine, ServerWeightPublisher
from vcpo.rollout.server_pool import ServerDown, ServerError, ServerPool
from vcpo.rollout.weights import _unaliased, write_weights_dir
from vcpo.types import SamplingParams

SHAPES = json.loads((Path(__file__).parent / "fixtures" / "server_shapes.json").read_text())
URL = "http://127.0.0.1:9"


class Scripted:
    """An httpx transport answering each path from a list of (status, body), recording every request."""

    def __init__(self, answers: dict[str, list[tuple[int, object]]]) -> None:
        self.answers = {k: list(v) for k, v in answers.items()}
        self.requests: list[tuple[str, dict, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.url.path, dict(request.url.params), body))
        status, answer = self.answers[request.url.path].pop(0)
        return httpx.Response(status, json=answer)


def engine(kind: str, answers, tmp_path: Path, version: int = 4) -> tuple[ServerRolloutEngine, Scripted]:
    script = Scripted(answers)
    pool = ServerPool([URL], kind, model="policy" if kind == "vllm" else None, retries=1, retry_backoff_s=0.0,
                      transport=httpx.MockTransport(script))
    return ServerRolloutEngine(pool, ServerWeightPublisher(pool, tmp_path / "w"), version=version), script


SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=2)


@pytest.mark.parametrize(("kind", "route", "first", "then"), [
    ("vllm", "/v1/completions", "vllm_completion", "vllm_continuation"),
    ("sglang", "/generate", "sglang_generate", "sglang_continuation"),
])
def test_an_aborted_row_continues_with_its_tokens_and_the_remaining_budget(kind, route, first, then, tmp_path):
    eng, script = engine(kind, {route: [(200, SHAPES[first]), (200, SHAPES[then])]}, tmp_path)
    gens = eng.generate([[5, 6], [7]], SAMPLING)
    # Row 0: token 11 then a pause (abort), continued as [5, 6, 11] with 1 token left -> EOS (1), finished.
    assert (gens[0].response_ids, gens[0].behavior_logprobs, gens[0].finished) == ([11, 1], [-0.25, -0.125], True)
    assert (gens[1].response_ids, gens[1].behavior_logprobs, gens[1].finished) == ([12, 13], [-0.5, -1.5], False)
    assert gens[0].versions == [4, 4] and gens[1].versions == [4, 4]  # untagged: the version known at each send
    (_, _, sent), (_, _, resent) = script.requests
    if kind == "vllm":
        assert sent == {"prompt": [[5, 6], [7]], "max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "logprobs": 0,
                        "return_token_ids": True, "model": "policy"}
        assert (resent["prompt"], resent["max_tokens"]) == ([[5, 6, 11]], 1)
    else:
        assert sent == {"input_ids": [[5, 6], [7]], "return_logprob": True,
                        "sampling_params": {"max_new_tokens": 2, "temperature": 0.7, "top_p": 0.9}}
        assert (resent["input_ids"], resent["sampling_params"]["max_new_tokens"]) == ([[5, 6, 11]], 1)


def test_vllm_update_is_pause_update_config_reload_resume(tmp_path):
    ok = [(200, SHAPES["vllm_collective_rpc"])] * 2
    eng, script = engine("vllm", {"/pause": [(200, SHAPES["vllm_pause"])], "/collective_rpc": ok,
                                  "/resume": [(200, SHAPES["vllm_resume"])]}, tmp_path)
    eng.load_weights({"w": torch.ones(2)}, 5)
    path = str((tmp_path / "w" / "v00000005").resolve())
    assert [(p, q, b) for p, q, b in script.requests] == [
        ("/pause", {"mode": "abort"}, None),
        ("/collective_rpc", {}, {"method": "update_config", "args": [{"model_config": {"model": path}}]}),
        ("/collective_rpc", {}, {"method": "reload_weights"}),
        ("/resume", {}, None)]
    assert eng.version == 5 and (tmp_path / "w" / "v00000005" / "model.safetensors").is_file()


def test_sglang_update_reported_failed_raises_one_line_and_still_resumes(tmp_path):
    eng, script = engine("sglang", {"/pause_generation": [(200, SHAPES["sglang_pause"])],
                                    "/update_weights_from_disk": [(200, SHAPES["sglang_update_failed"])],
                                    "/continue_generation": [(200, SHAPES["sglang_continue"])]}, tmp_path)
    with pytest.raises(ServerError, match="update_weights_from_disk failed: Failed to update weights: size mismatch"):
        eng.load_weights({"w": torch.ones(2)}, 5)
    assert [p for p, _, _ in script.requests] == ["/pause_generation", "/update_weights_from_disk",
                                                  "/continue_generation"]
    assert script.requests[1][2] == {"model_path": str((tmp_path / "w" / "v00000005").resolve()),
                                     "weight_version": "5"}
    assert eng.version == 4  # not advanced: the servers still hold the old weights


def test_5xx_is_retried_then_the_server_is_down_and_4xx_is_one_clear_error(tmp_path, capfd):
    error = {"object": "error", "message": "engine dead\nTraceback ...", "type": "InternalServerError", "code": 500}
    eng, script = engine("vllm", {"/v1/completions": [(500, error), (500, error)]}, tmp_path)
    with pytest.raises(ServerError, match="every rollout server is down"):
        eng.generate([[5]], SAMPLING)
    assert len(script.requests) == 2  # one try + one retry
    assert "is down (HTTP 500 on /v1/completions: engine dead); skipped from now on, 0 left" in capfd.readouterr().err
    bad = {"object": "error", "message": "max_tokens must be at least 1", "type": "BadRequestError", "code": 400}
    eng, _ = engine("vllm", {"/v1/completions": [(400, bad)]}, tmp_path)
    with pytest.raises(ServerError, match=r"refused /v1/completions \(HTTP 400\): max_tokens must be at least 1"):
        eng.generate([[5]], SAMPLING)


@pytest.mark.parametrize(("mangle", "named"), [
    (lambda b: b["choices"].pop(), "1 choices for 2 prompts"),
    (lambda b: b["choices"][0].pop("token_ids"), "no token_ids"),
    (lambda b: b["choices"][0].update(finish_reason="weird"), "finish_reason 'weird'"),
    (lambda b: b["choices"][1]["logprobs"]["token_logprobs"].pop(), "different lengths"),
])
def test_a_response_of_the_wrong_shape_is_one_error_naming_the_field(mangle, named, tmp_path):
    body = json.loads(json.dumps(SHAPES["vllm_completion"]))
    mangle(body)
    eng, _ = engine("vllm", {"/v1/completions": [(200, body)]}, tmp_path)
    with pytest.raises(ServerError, match=named):
        eng.generate([[5, 6], [7]], SAMPLING)


def test_a_connection_refused_server_is_down_after_its_retries():
    pool = ServerPool(["http://127.0.0.1:1"], retries=1, retry_backoff_s=0.0, connect_timeout_s=1.0)
    with pytest.raises(ServerDown, match="127.0.0.1:1 is down: ConnectError"):
        pool.call(pool.urls[0], pool.api.resume()[0])
    with pytest.raises(ServerError, match="every rollout server is down"):
        pool.live()


def test_a_zero_budget_sends_nothing(tmp_path):
    eng, script = engine("vllm", {}, tmp_path)
    gens = eng.generate([[5], [6, 7]], SamplingParams(max_new_tokens=0))
    assert [(g.response_ids, g.versions, g.finished) for g in gens] == [([], [], False)] * 2 and not script.requests


def test_weight_directories_keep_the_newest_and_drop_an_abandoned_timeline(tmp_path):
    state = {"w": torch.arange(3.0)}
    for v in range(5):
        write_weights_dir(tmp_path, state, v, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003", "v00000004"]
    write_weights_dir(tmp_path, state, 2, keep_last=2)  # resumed from step 2: 3 and 4 never happened
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002"]
    write_weights_dir(tmp_path, state, 3, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000003"]
    assert torch.equal(load_file(tmp_path / "v00000003" / "model.safetensors")["w"], state["w"])


def test_tied_tensors_are_written_once():
    shared = torch.ones(4, 2)
    state = {"model.embed_tokens.weight": shared, "lm_head.weight": shared, "norm": torch.ones(2)}
    assert set(_unaliased(state)) == {"model.embed_tokens.weight", "norm"}
