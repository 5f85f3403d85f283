"""Agent tasks through the real ``openai`` client: the endpoint records exactly what the engine sampled (not a
re-tokenization of the transcript), multi-call episodes become one masked trajectory, per-token versions survive
in-flight updates, tool calls come back in OpenAI's fields, streaming works, and every failure drops its group with
nothing left running."""

from __future__ import annotations

import socket
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vcpo.agents.task import AgentTask, AgentTaskError
from vcpo.config import TaskConfig
from vcpo.models.default import BASE_CHARACTERS, build_char_tokenizer
from vcpo.rollout.collect import collect_groups
from vcpo.rollout.engine import HFRolloutEngine
from vcpo.types import DROPPED_STATUS, Generation, Problem, SamplingParams, Trajectory, is_dropped_group

from conftest import CHAT_TEMPLATE

TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=200)


def chat_tokenizer():
    tokenizer = build_char_tokenizer(BASE_CHARACTERS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class ScriptedEngine:
    """A rollout engine that writes a tool call until the context holds a tool's answer, then ``\\boxed{5}``, each
    turn ending with EOS; the version goes up by one after every sampled token (an in-flight update between every
    decode step). Every generation is kept, to compare with what the endpoint recorded."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.version = 0
        self.generations: list[tuple[list[int], Generation]] = []

    def generate(self, prompt_ids, sampling, *, weight_poll=None, generator=None, greedy=False):
        out = []
        for prompt in prompt_ids:
            text = self.tokenizer.decode(prompt)
            reply = "\\boxed{5}" if "<|tool|>5" in text else TOOL_CALL if "<|user|>" in text else " 5"
            ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"][: sampling.max_new_tokens - 1]
            ids.append(self.tokenizer.eos_token_id)
            versions = [self.version + n for n in range(len(ids))]
            gen = Generation(ids, [-0.01 * (n + 1) for n in range(len(ids))], versions, True)
            self.version += len(ids)
            self.generations.append((list(prompt), gen))
            out.append(gen)
        return out


def agent_task(function: str, **kwargs) -> AgentTask:
    return AgentTask(TaskConfig(name=f"agent:agents_for_tests:{function}", kwargs={"problems": "chain_sum",
                                                                                  **kwargs}))


def problem(uid: str, **metadata) -> Problem:
    return Problem(uid=uid, prompt="What is 2 + 3?", answer="5", metadata=metadata)


@pytest.fixture
def closing():
    """Tasks to close after the test, whatever it did; each closed task must leave no runner alive."""
    tasks: list[AgentTask] = []
    yield tasks
    for task in tasks:
        session = task._session
        task.close()
        if session is not None and session._runner is not None:
            assert not session._runner.alive()


def test_a_multi_turn_tool_agent_trains_on_the_sampled_ids_with_tool_output_masked(closing):
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(tokenizer)
    task = agent_task("tool_agent")
    closing.append(task)
    groups = collect_groups(engine, tokenizer, task, [problem("p0")], [7], 2, SAMPLING, torch.Generator())
    assert len(groups) == 1 and len(groups[0]) == 2  # one row per episode: its two calls joined
    (first_prompt, first), (second_prompt, second) = engine.generations[0], engine.generations[2]
    assert len(engine.generations) == 4  # two episodes, two calls each, batched together
    for t in groups[0]:
        assert t.reward == 1.0 and t.group_id == 7 and t.reward_status == "ok"
        assert t.prompt_ids == first_prompt
        # the second prompt is the first context exactly as sampled (EOS included) and then the tool's turn
        assert second_prompt[: len(first_prompt) + len(first.response_ids)] == first_prompt + first.response_ids
        between = second_prompt[len(first_prompt) + len(first.response_ids):]
        assert tokenizer.decode(between) == "\n<|tool|>5\n<|assistant|>"
        assert t.response_ids == first.response_ids + between + second.response_ids
        assert t.response_mask == [1] * len(first.response_ids) + [0] * len(between) + [1] * len(
            second.response_ids)
        assert t.behavior_logprobs == first.behavior_logprobs + [0.0] * len(between) + second.behavior_logprobs
        assert t.env_stats["turns"] == 2.0 and t.env_stats["tool_calls"] == 1.0
    # versions: every sampled token keeps the version it was sampled at (here one update between every two tokens,
    # so each token has its own); the masked tokens repeat the version of the model token before them
    sampled = {(tuple(p), tuple(g.versions)): g for p, g in engine.generations}
    n1 = len(first.response_ids)
    for t in groups[0]:
        opening = sampled[(tuple(t.prompt_ids), tuple(t.versions[:n1]))]
        tail = n1 + len(between)
        closing_turn = sampled[(tuple(t.prompt_ids + t.response_ids[:tail]), tuple(t.versions[tail:]))]
        assert t.versions[n1:tail] == [opening.versions[-1]] * len(between)
        assert t.model_versions() == opening.versions + closing_turn.versions
    assert groups[0][0].versions != groups[0][1].versions  # two episodes, batched: each its own tokens
    # re-rendering the transcript with the template does not give the trained ids: the template writes the
    # assistant's turn as text + "\n" where the policy sampled EOS, and the tool call in its own spelling
    t = groups[0][0]
    transcript = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": TOOL_CALL},
                  {"role": "tool", "content": "5"}, {"role": "assistant", "content": "\\boxed{5}"}]
    retokenized = tokenizer(tokenizer.apply_chat_template(transcript, tokenize=False), add_special_tokens=False)
    assert retokenized["input_ids"] != t.prompt_ids + t.response_ids
    assert tokenizer.eos_token_id in t.response_ids


def test_tool_calls_come_back_in_openai_fields_and_streams_match(closing):
    from openai import OpenAI

    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(tokenizer)
    task = agent_task("tool_agent")
    closing.append(task)
    session = task.session(tokenizer, 200)
    session.book.open(["e1"])
    client = OpenAI(base_url=session.server.base_url("e1"), api_key="unused", max_retries=0)
    import threading

    answers: dict[str, object] = {}

    def call() -> None:
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        answers["plain"] = client.chat.completions.create(model="policy", messages=messages,
                                                          tools=[_add_tool()], logprobs=True)
        stream = client.chat.completions.create(model="policy", messages=messages, tools=[_add_tool()],
                                                stream=True)
        answers["chunks"] = list(stream)

    thread = threading.Thread(target=call)
    thread.start()
    while thread.is_alive():  # the test is the collector here: it answers what the endpoint files
        for pending in session.book.take(0.05, expected=1):
            pending.future.set_result(engine.generate([pending.prompt_ids], SAMPLING)[0])
    thread.join()
    choice = answers["plain"].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "add" and tool_call.function.arguments == '{"a": 2, "b": 3}'
    assert [c.logprob for c in choice.logprobs.content] == engine.generations[0][1].behavior_logprobs
    assert choice.model_extra["token_ids"] == engine.generations[0][1].response_ids
    chunks = answers["chunks"]
    streamed = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert streamed[0][0].function.name == "add" and chunks[-1].choices[0].finish_reason == "tool_calls"
    session.book.end("e1")


def _add_tool() -> dict:
    from agents_for_tests import ADD_TOOL

    return ADD_TOOL


def test_an_async_streaming_completions_agent_and_rows_per_call(closing):
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(tokenizer)
    task = agent_task("streaming_agent", rows="call")
    closing.append(task)
    groups = collect_groups(engine, tokenizer, task, [problem("p0")], [0], 3, SAMPLING, torch.Generator())
    rows = groups[0]
    assert len(rows) == 6  # rows: call -> one row per call, three episodes of two calls
    assert all(t.reward == 1.0 and t.response_mask == [1] * len(t.response_ids) for t in rows)
    recorded = sorted((tuple(t.prompt_ids), tuple(t.response_ids), tuple(t.versions)) for t in rows)
    sampled = sorted((tuple(p), tuple(g.response_ids), tuple(g.versions)) for p, g in engine.generations)
    assert recorded == sampled
    # the second call's prompt was spliced: the first context as sampled (EOS kept), then " = "
    second = [p for p, _ in engine.generations if tokenizer.decode(p, skip_special_tokens=True).endswith(" = ")]
    assert len(second) == 3 and all(tokenizer.eos_token_id in p for p in second)


def tiny_llama(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return LlamaForCausalLM(config).eval()


class Recorder:
    """An engine's generate calls and answers, kept (the engine itself runs unchanged)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[tuple[list[list[int]], list[Generation]]] = []

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, prompt_ids, sampling, **kwargs):
        gens = self.engine.generate(prompt_ids, sampling, **kwargs)
        self.calls.append(([list(p) for p in prompt_ids], gens))
        return gens


def test_a_real_engine_with_in_flight_updates_records_ids_logprobs_and_versions(closing):
    tokenizer = build_char_tokenizer(BASE_CHARACTERS)
    model = tiny_llama(tokenizer)
    engine = Recorder(HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    steps = {"n": 0}

    def poll():  # a new policy version before every third decode step
        steps["n"] += 1
        return (engine.version + 1, state) if steps["n"] % 3 == 0 else None

    task = agent_task("sum_agent")
    closing.append(task)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8)
    groups = collect_groups(engine, tokenizer, task, [problem("a"), problem("b")], [0, 1], 2, sampling,
                            torch.Generator().manual_seed(0), weight_poll=poll)
    sampled = {(tuple(p), tuple(g.response_ids)): g for prompts, gens in engine.calls for p, g in
               zip(prompts, gens, strict=True)}
    spans = 0
    for t in (t for g in groups for t in g):
        assert t.reward_status == "ok" and len(t.response_ids) == len(t.versions) == len(t.response_mask)
        first_len = t.response_mask.index(0) if 0 in t.response_mask else len(t.response_ids)
        first = sampled[(tuple(t.prompt_ids), tuple(t.response_ids[:first_len]))]
        assert t.behavior_logprobs[:first_len] == first.behavior_logprobs and t.versions[:first_len] == first.versions
        spans += len(set(t.model_versions())) > 1
        # the trajectory's model tokens are exactly some generate call's sampled tokens, in order
        second = t.response_ids[first_len:]
        masked = t.response_mask[first_len:].count(0)
        context = t.prompt_ids + t.response_ids[: first_len + masked]
        assert (tuple(context), tuple(second[masked:])) in sampled
    assert spans > 0  # the updates landed inside episodes: one trajectory holds several versions


@pytest.mark.parametrize("behavior, reason", [
    ("raise", "raised ValueError: the agent broke"), ("silent", "returned without calling the endpoint"),
    ("hang", "timed out after task.kwargs.agent_timeout_s=2 s"),
])
def test_a_failing_agent_drops_its_group_with_one_line_and_nothing_left_running(closing, capsys, behavior, reason):
    tokenizer = chat_tokenizer()
    # a short timeout only where it is the failure: on a loaded machine 2 s can pass before an agent has run at all
    task = agent_task("scripted_agent", agent_timeout_s=2 if behavior == "hang" else 60, agent_retries=1)
    closing.append(task)
    problems = [problem("good", behavior="ok"), problem("bad", behavior=behavior)]
    start = time.monotonic()
    groups = collect_groups(ScriptedEngine(tokenizer), tokenizer, task, problems, [0, 1], 2, SAMPLING,
                            torch.Generator())
    assert time.monotonic() - start < 300  # "hang" sleeps 600 s: only the timeout ends it sooner
    assert not is_dropped_group(groups[0]) and [t.reward for t in groups[0]] == [1.0, 1.0]
    assert is_dropped_group(groups[1])
    (marker,) = groups[1]
    assert marker.reward_status == DROPPED_STATUS and not marker.trainable and marker.response_ids == []
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "problem bad" in line]
    # one line per failed episode in each of the two attempts (retried once), then the drop
    assert len(lines) == 5 and all(reason in line for line in lines[:4]), lines
    assert "dropped" in lines[4] and "retrying 1 group(s) (attempt 2 of 2)" in err
    if behavior == "hang":  # the runner holding the hung agents was stopped with the collection
        assert task._session._runner is None


@pytest.mark.parametrize("behavior, refusal", [("late", "already returned"),
                                               ("late_raise", "was dropped: raised RuntimeError: gave up")])
def test_a_call_after_the_episode_ended_is_refused_and_drops_the_group(closing, tmp_path, behavior, refusal):
    tokenizer = chat_tokenizer()
    task = agent_task("scripted_agent", agent_timeout_s=20)
    closing.append(task)
    log = tmp_path / "late.txt"
    problems = [problem("late", behavior=behavior, log=str(log)), problem("slow", behavior="slow")]
    groups = collect_groups(ScriptedEngine(tokenizer), tokenizer, task, problems, [0, 1], 1, SAMPLING,
                            torch.Generator())
    assert log.read_text().startswith("410 ") and refusal in log.read_text()
    assert is_dropped_group(groups[0]) and not is_dropped_group(groups[1])


def test_close_stops_the_endpoint_and_the_runner(closing):
    tokenizer = chat_tokenizer()
    task = agent_task("tool_agent")
    collect_groups(ScriptedEngine(tokenizer), tokenizer, task, [problem("p")], [0], 1, SAMPLING, torch.Generator())
    session = task._session
    runner, port = session._runner, session.server.port
    assert runner.alive()
    task.close()
    assert not runner.alive() and not session.server._thread.is_alive()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


@pytest.mark.parametrize("kwargs, match", [
    ({}, "needs task.kwargs.problems"), ({"problems": "agent:x:y"}, "needs task.kwargs.problems"),
    ({"problems": "chain_sum", "rows": "turn"}, "rows must be 'episode' or 'call'"),
    ({"problems": "chain_sum", "agent_timeout_s": 0}, "agent_timeout_s must be in"),
    ({"problems": "chain_sum", "depth": 3}, "task.kwargs.depth is not an agent task setting"),
])
def test_bad_agent_settings_are_one_line(kwargs, match):
    with pytest.raises(AgentTaskError, match=match):
        AgentTask(TaskConfig.model_construct(name="agent:agents_for_tests:tool_agent", kwargs=kwargs))
    with pytest.raises(AgentTaskError, match="has no attribute 'nope'"):
        AgentTask(TaskConfig.model_construct(name="agent:agents_for_tests:nope", kwargs={"problems": "chain_sum"}))


def test_an_agent_on_a_vcpo_serve_engine_is_trained_on_the_context_the_server_sampled_from(closing, tmp_path):
    from vcpo.models.loading import load_policy
    from vcpo.rollout.server import ServerRolloutEngine
    from vcpo.rollout.server_pool import ServerPool

    from conftest import save_tiny_policy, serving

    policy = save_tiny_policy(tmp_path / "policy")
    model, tokenizer = load_policy(policy, "float32", "cpu")
    task = agent_task("sum_agent")
    closing.append(task)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)
    with serving(policy) as procs:
        engine = ServerRolloutEngine(ServerPool([procs[0][0]], "vcpo", retries=1, request_timeout_s=60))
        groups = collect_groups(engine, tokenizer, task, [problem("a"), problem("b")], [0, 1], 2, sampling,
                                torch.Generator().manual_seed(0))
    for t in (t for g in groups for t in g):
        assert t.reward_status == "ok" and t.env_stats["turns"] == 2.0 and 0 in t.response_mask
        # the learner's log-probs of the trajectory as recorded equal the server's at every sampled token: the
        # trajectory is the context each call was sampled from, calls and the text between them included
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        P = len(t.prompt_ids)
        for i, (token, sampled, m) in enumerate(zip(t.response_ids, t.behavior_logprobs, t.response_mask,
                                                    strict=True)):
            if m:
                assert abs(float(logp[P + i - 1, token]) - sampled) < 1e-4


def test_sync_and_lagged_sources_leave_dropped_groups_out_count_them_and_stop_on_a_batch_of_none(monkeypatch):
    from vcpo.errors import RunFailed
    from vcpo.orchestration import local

    def row(group_id: int, status: str = "ok") -> Trajectory:
        return Trajectory("p", group_id, [1], [2], [-0.1], [0], 1.0, True, SAMPLING, reward_status=status)

    batches = {0: [row(0), row(0), row(1, DROPPED_STATUS)], 1: [row(2, DROPPED_STATUS), row(3)],
               2: [row(4, DROPPED_STATUS)]}
    monkeypatch.setattr(local, "_generate_batch", lambda engine, ctx, index: batches.get(index, [row(9)]))

    class Engine:
        version = 0

    for source in (local.SyncSource(Engine(), None), local.LaggedSource(Engine(), None, max_staleness=1)):
        assert [t.group_id for t in source.next_batch(0)] == [0, 0]
        assert source.metrics()["agent/dropped_groups"] == 1.0
        assert [t.group_id for t in source.next_batch(1)] == [3]
        assert source.metrics()["agent/dropped_groups"] == 2.0
        with pytest.raises(RunFailed, match="every group of batch 2 was dropped by the agent task"):
            source.next_batch(2)


def test_an_agent_connection_idle_longer_than_uvicorns_default_keep_alive_is_still_open():
    """An agent runs a tool between two calls on one pooled connection: uvicorn's default keep-alive (5 s) closed it
    under the client, whose next call failed with a connection error (3 of 480 groups in a 60-step tool run)."""
    import http.client

    from fastapi import FastAPI

    from vcpo.agents.endpoint import EndpointServer

    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    server = EndpointServer(app)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/ping")
        assert conn.getresponse().read() == b'{"ok":true}'
        first = conn.sock
        time.sleep(6)
        conn.request("GET", "/ping")
        assert conn.getresponse().read() == b'{"ok":true}' and conn.sock is first
        conn.close()
    finally:
        server.close()
