"""``async.batch_order`` (issue 45, item 3): on a skewed task (long responses take 10x as long and are the hard ones)
the staleness bound with arrival order trains shorter, easier groups than it generated; with admission order it
trains exactly what it generated and no group exceeds the bound. A discrete-event simulation of async mode with the
real staleness controller, group order and tally (workers that take their tickets one at a time, a fixed learner step
time); no process, no model. And the real async source with a stand-in worker: the order it hands groups over, and
the groups it saves in a checkpoint and takes first after a resume (a whole run: tests/test_fault_injection.py)."""

from __future__ import annotations

import multiprocessing
import os
import random

import pytest
import torch
import transformers

from vcpo.errors import RunFailed
from vcpo.orchestration.async_local import AsyncSource, WorkerSpec, _Worker
from vcpo.orchestration.ordering import AdmissionOrder, ArrivalOrder, make_order
from vcpo.orchestration.staleness import StalenessController
from vcpo.orchestration.tally import GroupTally
from vcpo.types import SamplingParams, Trajectory

TOLERANCE = {"length_mean": 1.0, "pass_rate": 0.02}
"""Largest |trained - generated| accepted over the run: one token of mean length, two points of pass rate."""


def _group(index: int, length: int, correct: int, version: int, size: int = 4) -> list[Trajectory]:
    return [Trajectory(problem_uid=str(index), group_id=index, prompt_ids=[1], response_ids=[2] * length,
                       behavior_logprobs=[0.0] * length, versions=[version] * length, reward=float(j < correct),
                       finished=True, sampling=SamplingParams()) for j in range(size)]


def simulate(order: str, steps: int = 80, P: int = 4, workers: int = 3, k: int = 1, alpha: float | None = None,
             seed: int = 0) -> dict[str, float]:
    """Run ``steps`` learner steps; returns the run's levels pooled over groups (as vcpo.study.bias pools them) and
    the largest lag trained. Group i is long (100 tokens, 1 of 4 correct) or short (10 tokens, 3 of 4) with
    probability 1/2; a worker generates one group at a time, 0.01 s a token; a learner step takes 0.5 s."""
    rng = random.Random(seed)
    controller = StalenessController(k, P, alpha, admit_within_alpha=order == "admission")  # as AsyncSource builds it
    groups_order = make_order(order, 0)
    tally = GroupTally()
    queues: list[list[tuple[int, int]]] = [[] for _ in range(workers)]  # (index, admitted version) per worker
    busy: list[tuple[float, list[Trajectory]] | None] = [None] * workers
    now, next_index, max_lag = 0.0, 0, 0
    sums = {kind: {"count": 0.0, **dict.fromkeys(TOLERANCE, 0.0)} for kind in ("generated", "trained", "dropped")}

    def admit() -> None:
        nonlocal next_index
        while (version := controller.try_admit()) is not None:
            held = [len(q) + (busy[w] is not None) for w, q in enumerate(queues)]
            queues[held.index(min(held))].append((next_index, version))
            next_index += 1
        for w in range(workers):
            start(w)

    def start(w: int) -> None:
        if busy[w] is None and queues[w]:
            index, _ = queues[w].pop(0)
            long = rng.random() < 0.5
            length, correct = (100, 1) if long else (10, 3)
            busy[w] = (now + 0.01 * length, _group(index, length, correct, controller.version))

    def run_until(t: float) -> None:
        nonlocal now
        while (done := [w for w in range(workers) if busy[w] is not None and busy[w][0] <= t]):
            w = min(done, key=lambda w: busy[w][0])
            now, group = busy[w]
            busy[w] = None
            groups_order.put(group)
            start(w)
        now = t

    admit()
    for version in range(steps):
        kept = 0
        while kept < P:
            while (group := groups_order.peek()) is None:
                run_until(min(b[0] for b in busy if b is not None))
            groups_order.pop()
            if controller.keep(group, version):
                max_lag = max(max_lag, version - group[0].min_version)
                tally.add(group, "trained")
                kept += 1
            else:
                tally.add(group, "dropped")
                admit()
        step = tally.take()
        for kind in ("generated", "trained", "dropped"):
            n = step[f"groups/{kind}_count"]
            sums[kind]["count"] += n
            for figure in TOLERANCE:
                sums[kind][figure] += n * step.get(f"groups/{kind}_{figure}", 0.0)
        run_until(now + 0.5)
        controller.set_version(version + 1)
        admit()
    levels = {f"{kind}_{figure}": sums[kind][figure] / sums[kind]["count"] if sums[kind]["count"] else None
              for kind in sums for figure in TOLERANCE}
    return {"max_lag": max_lag, "dropped": sums["dropped"]["count"], **levels}


def _bias(run: dict[str, float]) -> dict[str, float]:
    return {figure: run[f"trained_{figure}"] - run[f"generated_{figure}"] for figure in TOLERANCE}


@pytest.mark.parametrize("order", [
    pytest.param("arrival", marks=pytest.mark.xfail(strict=True, reason="today's rule: long, hard groups are "
                                                    "overtaken, exceed the bound and are dropped")),
    "admission"])
@pytest.mark.parametrize(("k", "alpha"), [(1, None), (2, 1.0)], ids=["bound", "drop_older_than"])
def test_the_trained_groups_are_the_generated_ones_on_the_skewed_task(order, k, alpha):
    # arrival, k = 1 (seed 0): 33 of 353 generated groups dropped, all long; trained length 49.7 against 54.4
    # generated, pass rate 0.530 against 0.504
    run = simulate(order, k=k, alpha=alpha)
    for figure, bias in _bias(run).items():
        assert abs(bias) <= TOLERANCE[figure], (figure, run)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("k", "alpha"), [(0, None), (1, None), (3, None), (3, 1.0), (2, 0.0)])
def test_admission_order_keeps_the_bound_and_drops_nothing(k, alpha, seed):
    run = simulate("admission", k=k, alpha=alpha, seed=seed, steps=40)
    assert run["dropped"] == 0 and _bias(run) == {"length_mean": 0.0, "pass_rate": 0.0}
    assert run["max_lag"] <= min(k, k if alpha is None else int(alpha))


def test_admission_order_holds_a_group_until_every_earlier_one_is_taken():
    order = make_order("admission", 5)
    assert isinstance(order, AdmissionOrder) and isinstance(make_order("arrival", 5), ArrivalOrder)
    order.put(_group(6, 3, 1, 0))
    assert order.peek() is None and [g[0].group_id for g in order.groups()] == [6]  # 5 is still out
    order.put(_group(5, 9, 1, 0))
    assert [g[0].group_id for g in order.groups()] == [5, 6]
    assert order.peek()[0].group_id == 5 and order.peek() is order.peek()  # a peek takes nothing
    assert [order.pop()[0].group_id, order.pop()[0].group_id, order.peek()] == [5, 6, None]
    arrival = ArrivalOrder()
    arrival.put(_group(6, 3, 1, 0))
    arrival.put(_group(5, 3, 1, 0))
    assert [g[0].group_id for g in arrival.groups()] == [6, 5] and arrival.peek()[0].group_id == 6
    assert [arrival.pop()[0].group_id, arrival.pop()[0].group_id, arrival.peek()] == [6, 5, None]


def test_admission_order_after_a_resume_takes_the_held_indices_first_then_the_stream():
    # a checkpoint held 7 and 3 (finished or not) and 5; 4 and 6 were taken before it (a step's dynamic-sampling drops
    # leave such gaps); the stream continues at 9; an index at or past it is the stream's own
    order = make_order("admission", 9, pending=[7, 3, 5, 9])
    for index in (10, 9, 7, 5):
        order.put(_group(index, 3, 1, 0))
    assert order.peek() is None  # 3 is being generated again
    order.put(_group(3, 3, 1, 0))
    taken = []
    while order.peek() is not None:
        taken.append(order.pop()[0].group_id)
    assert taken == [3, 5, 7, 9, 10]


class _LiveProcess:
    """Stands in for a rollout worker process that stays alive (its groups come through the test's pipe)."""

    def __init__(self) -> None:
        self.sentinel, self._keep = os.pipe()  # never readable: the worker never dies
        self.exitcode = None

    def is_alive(self) -> bool:
        return True


def _source(order: str, tmp_path, start_version: int = 0) -> AsyncSource:
    spec = WorkerSpec(worker_id=0, model_path=str(tmp_path), dtype="float32", device="cpu", lm_head_fp32=False,
                      task_name="chain_sum", task_kwargs={}, seed=0, prompts_per_step=2, group_size=2,
                      sampling=SamplingParams(), inflight_updates=False, handoff_timeout_s=30)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32))
    return AsyncSource(model, spec, num_workers=1, max_staleness=1, drop_older_than=None, max_restarts=0,
                       start_version=start_version, batch_order=order)


def _attach(source: AsyncSource):
    """A stand-in worker for ``source``: the pipe end its groups are sent on, and the one its tickets arrive on."""
    results, worker_end = multiprocessing.Pipe(duplex=False)
    tickets_reader, tickets = multiprocessing.Pipe(duplex=False)
    source.workers = [_Worker(_LiveProcess(), tickets, results, multiprocessing.Lock())]
    return worker_end, tickets_reader


def _send(worker_end, *indices: int) -> None:
    for index in indices:
        worker_end.send(("group", _group(index, 3 if index % 2 else 30, 1, 0, size=2)))


def _take(source: AsyncSource, taken: list[list[int]], version: int = 0) -> None:
    for v, expected in enumerate(taken, start=version):
        source.controller.set_version(v)
        batch = source.next_batch(v)
        assert [t.group_id for t in batch[::2]] == expected
        assert source.metrics()["groups/dropped_count"] == 0.0


@pytest.mark.parametrize(("order", "taken"), [("admission", [[0, 1], [2, 3]]), ("arrival", [[1, 0], [3, 2]])])
def test_the_async_source_hands_groups_over_in_its_order(order, taken, tmp_path):
    source = _source(order, tmp_path)
    worker_end, tickets_reader = _attach(source)
    source._admit()  # k = 1: groups 0-3 (two steps of 2)
    assert [tickets_reader.recv() for _ in range(4)] == [0, 1, 2, 3]
    _send(worker_end, 1, 0, 3, 2)  # group 1 (short) overtakes group 0 (long), 3 overtakes 2
    _take(source, taken)
    worker_end.close()


@pytest.mark.parametrize(("order", "taken"), [("admission", [[0, 1], [2, 3]]), ("arrival", [[1, 3], [2, 0]])])
def test_a_resumed_async_source_trains_the_groups_it_held_first_in_its_order(order, taken, tmp_path):
    source = _source(order, tmp_path)
    worker_end, tickets_reader = _attach(source)
    source._admit()
    assert [tickets_reader.recv() for _ in range(4)] == [0, 1, 2, 3]
    _send(worker_end, 1, 3)  # 0 and 2 are still being generated at the stop
    state = source.state()
    assert ([g[0]["group_id"] for g in state["queued"]], state["requeued"], state["next_group"]) == ([1, 3], [0, 2], 4)

    resumed = _source(order, tmp_path)
    resumed.load_state(state)
    worker_end, tickets_reader = _attach(resumed)
    resumed._admit()  # the unfinished groups again, and nothing new: the held ones fill the bound
    assert [tickets_reader.recv() for _ in range(2)] == [0, 2] and not tickets_reader.poll(0.2)
    _send(worker_end, 2, 0)  # 2 overtakes 0
    resumed._drain()
    # admission order waits for group 0 (seeded at next_group it would wait for group 4, which is never admitted)
    assert resumed._order.peek()[0].group_id == (0 if order == "admission" else 1)
    _take(resumed, taken[:1])

    # stopped again in the middle of the next step: the step's groups (taken, not trained) are given back first
    state = resumed.state()
    assert [g[0]["group_id"] for g in state["queued"]] == [*taken[0], *taken[1]] and state["requeued"] == []
    again = _source(order, tmp_path)
    again.load_state(state)
    worker_end, _ = _attach(again)
    _take(again, taken)
    worker_end.close()


def test_admission_order_waiting_for_a_group_no_worker_holds_is_an_error_not_a_hang(tmp_path):
    source = _source("admission", tmp_path)
    worker_end, _ = _attach(source)
    source._admit()  # groups 0-3
    source._order = make_order("admission", 4)  # seeded past the groups it holds: the mistake this guards against
    _send(worker_end, 1, 0, 3, 2)
    with pytest.raises(RunFailed, match="waits for group 4, which no rollout worker holds"):
        source.next_batch(0)
    worker_end.close()
