"""Running a test body on n CPU ranks (gloo), and the engine drive the parallel tests share."""
from __future__ import annotations

import json
import os
import traceback

import torch
import torch.multiprocessing as mp

from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.parallel.comm import Comm, free_port
from dsv4.sampling_params import SamplingParams

MODEL = "random:tiny::hc_sinkhorn_iters=3"     # 3 Sinkhorn iterations: as tests/engine/conftest.py's tiny model
REL_TOL = 1e-4          # fp32: max|Δ| <= REL_TOL * max|ref| per logits row
# chunked prefill (a 48-token budget cuts the 300- and 150-token prompts; 300 crosses C128 groups)
# and mixed steps (decodes beside prefill chunks)
SMALL = dict(max_num_batched_tokens=48, num_pages=16, max_num_seqs=4, enable_prefix_caching=False)


def run_checks(checks: dict[str, tuple], n: int, out_dir: str) -> dict[str, str]:
    """Every check `name: (body, *args)` runs as body(comm, *args) on ranks 0..n-1 (one process
    each, started once for all the checks: starting a process costs more than a check).
    Returns name -> "" when it passed on every rank, else the failures, rank by rank. The
    checks run in the given order on every rank (their collectives must meet)."""
    mp.spawn(_rank_main, args=(n, free_port(), checks, out_dir), nprocs=n, join=True)
    results = {name: "" for name in checks}
    for rank in range(n):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            for name, failure in json.load(f).items():
                results[name] += f"rank {rank}: {failure}\n" if failure else ""
    return results


def _rank_main(rank, n, port, checks, out_dir):
    torch.set_num_threads(1)
    comm = Comm.init(rank, n, port, "cpu", timeout_s=60)
    results = {name: "not run: an earlier check failed on this rank" for name in checks}
    for name, (body, *args) in checks.items():
        try:
            body(comm, *args)
            results[name] = ""
        except Exception:  # noqa: BLE001 - reported by the test of that check
            results[name] = traceback.format_exc()
            break              # this rank's collectives no longer meet the others': stop here
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    # every collective of this rank has returned and its results are on disk: leave without
    # gloo's teardown, whose threads can abort the process ("terminate called without an active
    # exception") while a slower rank still tears down its side, failing a run whose checks passed
    os._exit(0)


def prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


class Recorder:
    """An engine over `model` whose steps' logits are kept (in step order)."""

    def __init__(self, model, **config):
        self.engine = LLMEngine(MODEL, EngineConfig(**{**SMALL, **config}), model=model)
        self.logits: list[torch.Tensor] = []
        run = self.engine.runner.run_seqs

        def recording(seqs, fill=None, images=None):
            out = run(seqs, fill, images)
            self.logits.append(out.logits.clone())
            return out
        self.engine.runner.run_seqs = recording

    def add(self, token_lists, max_tokens=6) -> None:
        for i, ids in enumerate(token_lists):
            self.engine.add_request(str(i), ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))

    def step(self) -> dict[str, list[int]]:
        return {o.request_id: o.token_ids for o in self.engine.step() if o.finished}

    def run(self) -> dict[str, list[int]]:
        done = {}
        while self.engine.has_unfinished():
            done.update(self.step())
        return done


def reference_run(token_lists, max_tokens: int) -> tuple[dict, list]:
    """The one-process run: (greedy tokens by request id, every step's logits)."""
    from dsv4.model.weights import load_model
    ref = Recorder(load_model(MODEL))
    ref.add(token_lists, max_tokens)
    return ref.run(), ref.logits


def assert_same_run(ours: Recorder, ours_done, ref: tuple[dict, list], what: str) -> None:
    """Greedy tokens identical to the reference run's; every step's logits within the fp32 tolerance."""
    ref_done, ref_logits = ref
    assert ours_done == ref_done, f"{what}: greedy tokens differ"
    assert len(ours.logits) == len(ref_logits), f"{what}: {len(ours.logits)} steps, reference {len(ref_logits)}"
    for i, (a, b) in enumerate(zip(ours.logits, ref_logits)):
        assert a.shape == b.shape, (what, i, a.shape, b.shape)
        if a.numel():
            err = float(((a - b).abs().amax(-1) / b.abs().amax(-1)).max())
            assert err <= REL_TOL, f"{what}: step {i} logits differ by {err:.3g} x max|ref|"
