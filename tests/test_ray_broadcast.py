"""The weight-broadcast group's packing, without Ray actors: two members in two threads of this process on a gloo
group of their own; mixed dtypes and a tied alias arrive exactly, the alias sent once."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import free_port

pytest.importorskip("ray")


def test_mixed_dtypes_and_a_tied_alias_arrive_exactly_in_one_buffer_per_dtype():
    from vcpo.orchestration.ray.broadcast import BroadcastMember, broadcast_layout

    g = torch.Generator().manual_seed(0)
    embed = torch.randn(5, 3, generator=g)
    state = {"embed.weight": embed, "norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
             "lm_head.weight": embed,  # tied: the same storage as embed.weight
             "steps": torch.tensor([7, -2], dtype=torch.int64), "proj.weight": torch.randn(2, 3, generator=g)}
    layout = broadcast_layout(state)
    # The alias is left out; the order is the state dict's: 3 dtypes, float32 = 5*3 + 2*3 = 21 values in one buffer.
    assert [key for key, _, _ in layout] == ["embed.weight", "norm.weight", "steps", "proj.weight"]
    port = free_port()
    members: dict[int, BroadcastMember] = {}

    def join(rank: int) -> None:
        members[rank] = BroadcastMember("127.0.0.1", port, rank, 2, 30.0, "gloo", layout)

    sender = threading.Thread(target=join, args=(0,))
    sender.start()
    join(1)
    sender.join()
    assert members[1].dtypes == [torch.float32, torch.bfloat16, torch.int64]
    sender = threading.Thread(target=members[0].send, args=(state,))
    sender.start()
    received = members[1].receive()
    sender.join()
    assert received.keys() == {"embed.weight", "norm.weight", "steps", "proj.weight"}
    for key, value in received.items():
        assert value.dtype == state[key].dtype and torch.equal(value, state[key])
