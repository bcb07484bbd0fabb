"""Running a test body on n CPU ranks (gloo), and the engine drive the parallel tests share."""
from __future__ import annotations

import torch
import torch.multiprocessing as mp

from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.parallel.comm import Comm, free_port
from dsv4.sampling_params import SamplingParams

MODEL = "random:tiny"
REL_TOL = 1e-4          # fp32: max|Δ| <= REL_TOL * max|ref| per logits row
# chunked prefill (a 48-token budget cuts the 300- and 150-token prompts; 300 crosses C128 groups)
# and mixed steps (decodes beside prefill chunks)
SMALL = dict(max_num_batched_tokens=48, num_pages=16, max_num_seqs=4, enable_prefix_caching=False)


def run_ranks(body, n: int, *args) -> None:
    """body(comm, *args) on ranks 0..n-1, each its own process; a failure on any rank fails."""
    mp.spawn(_rank_main, args=(n, free_port(), body, args), nprocs=n, join=True)


def _rank_main(rank, n, port, body, args):
    torch.set_num_threads(1)
    comm = Comm.init(rank, n, port, "cpu", timeout_s=60)
    try:
        body(comm, *args)
    finally:
        comm.close()


def prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


class Recorder:
    """An engine over `model` whose steps' logits are kept (in step order)."""

    def __init__(self, model, **config):
        self.engine = LLMEngine(MODEL, EngineConfig(**{**SMALL, **config}), model=model)
        self.logits: list[torch.Tensor] = []
        run = self.engine.runner.run_seqs

        def recording(seqs, fill=None):
            out = run(seqs, fill)
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


def assert_same_run(ours: Recorder, ref: Recorder, ours_done, ref_done, what: str) -> None:
    """Greedy tokens identical; every step's logits within the fp32 tolerance."""
    assert ours_done == ref_done, f"{what}: greedy tokens differ"
    assert len(ours.logits) == len(ref.logits), f"{what}: {len(ours.logits)} steps, reference {len(ref.logits)}"
    for i, (a, b) in enumerate(zip(ours.logits, ref.logits)):
        assert a.shape == b.shape, (what, i, a.shape, b.shape)
        if a.numel():
            err = float(((a - b).abs().amax(-1) / b.abs().amax(-1)).max())
            assert err <= REL_TOL, f"{what}: step {i} logits differ by {err:.3g} x max|ref|"
