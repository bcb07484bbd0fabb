"""The CUDA-graph paths of a speculative engine, run eagerly on the CPU (capture=False)."""
from __future__ import annotations

from dsv4.engine.cuda_graphs import StepGraphs


def with_graph_shapes(eng, graphs, max_bs: int = 4) -> dict:
    """Give the engine the padded verify graph (keeping what its runner keeps: streams for MTP,
    taps for DSpark) and the padded draft graph `graphs` (DraftGraphs or DSparkGraphs); count the
    calls that took them, and the draft steps that left greedy drafts on the device."""
    calls = {"verify": 0, "draft": 0, "held": 0}
    runner, proposer, k = eng.runner, eng.spec.proposer, eng.spec.k
    runner.graphs = StepGraphs(eng.model, runner.storage, max_bs, capture=False, h2d=runner.h2d,
                               keep_streams=runner.keep_hidden, keep_taps=runner.keep_taps)
    proposer.graphs = graphs(eng.model, runner.storage, max_bs, k + 1, capture=False, h2d=runner.h2d)
    for name, obj, method in (("verify", runner.graphs, "run_with_streams"), ("draft", proposer.graphs, "run")):
        original = getattr(obj, method)

        def counted(*a, _original=original, _name=name):
            calls[_name] += 1
            return _original(*a)
        setattr(obj, method, counted)
    hold = eng.spec.device_drafts.hold

    def held(*a):
        calls["held"] += 1
        return hold(*a)
    eng.spec.device_drafts.hold = held
    return calls
