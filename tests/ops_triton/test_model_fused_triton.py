"""A tiny model's prefill and padded decode steps give the same tokens and log-probs with the
fused row kernels (norm + RoPE, compressor pool / ring write) as with their torch references;
every other op stays on its reference, so only these kernels differ."""
import torch

from dsv4.config import EngineConfig
from dsv4.engine.cuda_graphs import StepGraphs
from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams
from dsv4.model.weights import load_model
from dsv4.ops import compress, norm, rope
from dsv4.ops.triton import compress as tri_compress
from dsv4.ops.triton import norm_rope as tri_norm_rope


def generate(model, prompt, steps):
    device = str(next(model.parameters()).device)
    eng = LLMEngine("random:tiny", EngineConfig(device=device, max_num_batched_tokens=256, max_num_seqs=2,
                                                num_pages=4), model=model)
    eng.runner.graphs = StepGraphs(model, eng.runner.storage, max_bs=2, capture=False)
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=0))
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                return out


def test_fused_kernels_keep_tokens_and_logprobs(monkeypatch, device):
    torch.set_num_threads(1)
    model = load_model("random:tiny", device)
    # 21 prompt tokens + 6 decode steps: C4 groups close in prefill and in decode (C128 groups
    # through the kernels: test_compress_triton.py's model test)
    prompt = [(7 * i + 3) % model.cfg.vocab_size for i in range(21)]
    want = generate(model, prompt, 6)
    launches = []
    for module, kernel in ((tri_norm_rope, "_norm_rope_kernel"), (tri_compress, "_pool_kernel"),
                           (tri_compress, "_ring_write_kernel")):
        real = getattr(module, kernel)
        monkeypatch.setattr(module, kernel, _Counted(real, kernel, launches))
    for ops in (norm, rope, compress):
        monkeypatch.setattr(ops, "use_triton", lambda t: True)
    got = generate(model, prompt, 6)
    assert {"_norm_rope_kernel", "_pool_kernel", "_ring_write_kernel"} <= set(launches)
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs):
        (ta, va), (tb, vb) = next(iter(a.items())), next(iter(b.items()))
        assert ta == tb and abs(va - vb) < 1e-4


class _Counted:
    """kernel[grid](...) with each launch's name recorded."""

    def __init__(self, kernel, name, launches):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        self.launches.append(self.name)
        return self.kernel[grid]
