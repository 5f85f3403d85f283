"""The server engine speaking vLLM and SGLang, against response shapes in tests/fixtures/server_shapes.json (some
captured from vLLM 0.32, the others written from the documented schemas; tests/with_vllm runs the real vLLM): requests,
the abort-and-continue loop, version tags, the weight-update sequence and check, retries and one-line errors."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from vcpo.rollout.server import ServerRolloutEngine, ServerWeightPublisher, WeightCheck
from vcpo.rollout.server_pool import ServerDown, ServerError, ServerPool
from vcpo.rollout.weights import _host_copies, write_weights_dir
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


def test_vllm_update_reads_the_version_once_then_pauses_reloads_from_the_path_and_resumes(tmp_path):
    eng, script = engine("vllm", {"/version": [(200, SHAPES["vllm_version"])],
                                  "/pause": [(200, SHAPES["vllm_pause"])] * 2,
                                  "/collective_rpc": [(200, SHAPES["vllm_collective_rpc"])] * 2,
                                  "/resume": [(200, SHAPES["vllm_resume"])] * 2}, tmp_path)
    eng.load_weights({"w": torch.ones(2)}, 5)
    eng.load_weights({"w": torch.ones(2)}, 6)
    paths = [str((tmp_path / "w" / f"v0000000{v}").resolve()) for v in (5, 6)]
    assert [(p, q, b) for p, q, b in script.requests] == [
        ("/version", {}, None),
        ("/pause", {"mode": "abort"}, None),
        ("/collective_rpc", {}, {"method": "reload_weights", "kwargs": {"weights_path": paths[0]}}),
        ("/resume", {}, None),
        ("/pause", {"mode": "abort"}, None),
        ("/collective_rpc", {}, {"method": "reload_weights", "kwargs": {"weights_path": paths[1]}}),
        ("/resume", {}, None)]
    assert eng.version == 6 and eng.pool.version_of(URL) == "0.32.0"


@pytest.mark.parametrize(("version", "outcome"), [("0.13.0", "older than the 0.32 release"),
                                                   ("0.33.1", "tested with 0.32"), ("0.32.0+cpu", None)])
def test_a_vllm_of_another_release_is_refused_when_older_and_warned_about_when_newer(version, outcome, tmp_path,
                                                                                      capfd):
    eng, script = engine("vllm", {"/version": [(200, {"version": version})], "/pause": [(200, {})],
                                  "/collective_rpc": [(200, {})], "/resume": [(200, {})]}, tmp_path)
    if outcome and outcome.startswith("older"):
        with pytest.raises(ServerError, match=rf"rollout server {URL}: runs vLLM 0\.13\.0, {outcome}"):
            eng.load_weights({"w": torch.ones(2)}, 5)
        assert [p for p, _, _ in script.requests] == ["/version"]  # nothing paused
        return
    eng.load_weights({"w": torch.ones(2)}, 5)
    assert (outcome in capfd.readouterr().err) if outcome else eng.version == 5


def test_a_refused_update_is_one_line_naming_server_route_and_message_and_the_server_is_resumed(tmp_path, capfd):
    eng, script = engine("vllm", {"/version": [(200, SHAPES["vllm_version"])], "/pause": [(200, {})],
                                  "/collective_rpc": [(500, SHAPES["vllm_rpc_failed"])], "/resume": [(200, {})]},
                         tmp_path)
    with pytest.raises(ServerError) as info:
        eng.load_weights({"w": torch.ones(2)}, 5)
    assert str(info.value) == (f"rollout server {URL} (vllm) refused /collective_rpc reload_weights (HTTP 500): Call "
                               f"to collective_rpc method failed: Worker failed with error 'Cannot find any model "
                               f"weights with `/tmp/vl`', please check the stack trace above for the root cause")
    assert [p for p, _, _ in script.requests] == ["/version", "/pause", "/collective_rpc", "/resume"]  # no retry
    assert eng.version == 4 and "is down" not in capfd.readouterr().err and eng.pool.live() == [URL]


class _Tiny(torch.nn.Module):
    """logits = embed(ids) @ embed.T: a model with a tied head, for the weight check."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 8)
        self.head = torch.nn.Linear(8, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.head(self.embed(input_ids))})()


@pytest.mark.parametrize("shift", [0.0, 0.01])
def test_the_weight_check_compares_the_servers_prompt_logprobs_with_the_learners(shift, tmp_path):
    model = _Tiny()
    with torch.no_grad():
        model.embed.weight.copy_(torch.eye(8))  # logits of token i: one-hot i, so log p(j | i) = [i = j] - log(e + 7)
    ids = [5, 6, 7]
    off = -torch.log(torch.tensor(torch.e + 7.0)).item()  # each next token differs from the last: -2.2736
    answer = json.loads(json.dumps(SHAPES["vllm_prompt_logprobs"]))
    answer["choices"][0]["prompt_logprobs"] = [None, {"6": {"logprob": off + shift}}, {"7": {"logprob": off}}]
    eng, script = engine("vllm", {"/version": [(200, SHAPES["vllm_version"])], "/pause": [(200, {})],
                                  "/collective_rpc": [(200, {})], "/resume": [(200, {})],
                                  "/v1/completions": [(200, answer)]}, tmp_path)
    eng.publisher.check = WeightCheck(model, ids, tol=1e-3)
    if shift:
        with pytest.raises(ServerError, match=rf"rollout server {URL} does not serve the learner's weights after the "
                                              rf"update to version 5: .* differ by up to 0\.01 "):
            eng.load_weights(model.state_dict(), 5)
    else:
        eng.load_weights(model.state_dict(), 5)
        assert eng.publisher.last_check_gap < 1e-6
    assert script.requests[-1][2] == {"prompt": [ids], "max_tokens": 1, "temperature": 1.0, "top_p": 1.0,
                                      "prompt_logprobs": 0, "return_token_ids": True, "model": "policy"}
    assert [p for p, _, _ in script.requests][-2:] == ["/resume", "/v1/completions"]  # scored after the resume


def test_rows_left_with_different_budgets_after_an_abort_continue_concurrently(tmp_path):
    """vLLM_completion aborts row 0 after 1 token, ends row 1 (2 tokens, length); a third row aborted at 0 tokens
    leaves budgets 1 and 2: both continuations must be in flight at once (each waits for the other at a barrier)."""
    first = json.loads(json.dumps(SHAPES["vllm_completion"]))
    first["choices"].append({"index": 2, "logprobs": {"token_logprobs": []}, "token_ids": [], "finish_reason": "abort"})
    both_sent = threading.Barrier(2, timeout=10)

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if len(body["prompt"]) == 3:
            return httpx.Response(200, json=first)
        both_sent.wait()  # a sequential client would time out here: the second call is never sent
        n = body["max_tokens"]
        return httpx.Response(200, json={"choices": [{"index": 0, "logprobs": {"token_logprobs": [-0.5] * n},
                                                      "token_ids": [9] * n, "finish_reason": "length"}]})

    pool = ServerPool([URL], "vllm", retries=0, transport=httpx.MockTransport(answer))
    gens = ServerRolloutEngine(pool, version=0).generate([[5, 6], [7], [8]], SAMPLING)
    assert [g.response_ids for g in gens] == [[11, 9], [12, 13], [9, 9]]


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


def test_an_error_status_is_one_clear_error_and_only_a_server_that_does_not_answer_is_down(tmp_path, capfd):
    error = {"object": "error", "message": "engine dead\nTraceback ...", "type": "InternalServerError", "code": 500}
    eng, script = engine("vllm", {"/v1/completions": [(500, error)]}, tmp_path)
    with pytest.raises(ServerError, match=r"refused /v1/completions \(HTTP 500\): engine dead$"):
        eng.generate([[5]], SAMPLING)
    assert len(script.requests) == 1 and "is down" not in capfd.readouterr().err  # a refusal: not retried
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


def test_tied_tensors_are_written_under_every_name(tmp_path):
    shared = torch.ones(4, 2)
    state = {"model.embed_tokens.weight": shared, "lm_head.weight": shared, "norm": torch.ones(2)}
    assert set(_host_copies(state)) == set(state)
    written = load_file(write_weights_dir(tmp_path, state, 0) / "model.safetensors")
    assert set(written) == set(state) and torch.equal(written["lm_head.weight"], shared)
