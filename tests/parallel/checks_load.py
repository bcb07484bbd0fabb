"""Loading a sharded checkpoint on every rank (engine/workers.py `load_rank_model`): each rank
ends with exactly its shard of every split weight and the whole of every other one."""
from __future__ import annotations

import torch

from dsv4.config import EngineConfig
from dsv4.engine.workers import load_rank_model
from dsv4.model.weights import load_model


def rank_holds_its_shard(comm, path: str, expert_parallel: bool) -> None:
    config = EngineConfig(tensor_parallel_size=comm.size, enable_expert_parallel=expert_parallel)
    full = dict(load_model(path).named_parameters())
    ours = dict(load_rank_model(path, config, comm).named_parameters())
    assert set(ours) == set(full)
    r, n, split = comm.rank, comm.size, 0
    for name, got in ours.items():
        want = full[name]
        if got.shape == want.shape:
            assert torch.equal(got, want), f"{name}: a whole weight differs from the checkpoint's"
            continue
        dim = next(d for d in range(want.dim()) if got.shape[d] != want.shape[d])
        assert got.shape[dim] * n == want.shape[dim], (name, got.shape, want.shape)
        if name.endswith("attn.wo_a.weight") and got.shape[1] != want.shape[1]:   # n > o-groups: rows and columns
            continue
        size = got.shape[dim]
        assert torch.equal(got, want.narrow(dim, r * size, size)), f"{name}: rank {r} holds another part"
        split += 1
    assert split > 0, "nothing was split"
