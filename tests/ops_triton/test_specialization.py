"""Every Triton kernel compiles once per configuration, not once per step shape: an integer
argument whose values depend on the step (tokens, entries, widths, splits, page-table pitch)
is in the kernel's `do_not_specialize`, so a long-running server never compiles a new variant
while a user waits (Triton otherwise specialises each integer on == 1 and on % 16).

Two engine runs with different prompt lengths launch every kernel the tiny model uses (all ops
on their Triton kernels, in the interpreter here); an integer argument whose set of values
differs between the runs varies with the step and must not be specialised. The model is the
tiny preset less its last layer (a repeat of the second: hash-MoE, C4 with indexer, C128 remain)
with 3 Sinkhorn iterations (a runtime loop bound, not a step size); the interpreter runs every
program in Python, so prompts of 5 and 17 tokens: the same 20 arguments vary as with 9 and 30."""
import importlib
import inspect
import pkgutil
from collections import defaultdict

import torch

import dsv4.ops as ops_pkg
import dsv4.ops.triton as triton_pkg
from dsv4.config import EngineConfig
from dsv4.engine.cuda_graphs import StepGraphs
from dsv4.engine.engine import LLMEngine
from dsv4.model.random_model import build_random_model
from dsv4.sampling_params import SamplingParams


THREE_LAYERS = dict(num_hidden_layers=3, compress_ratios=[0, 4, 128, 0], mlp_layer_types=["hash_moe", "moe", "moe"],
                    hc_sinkhorn_iters=3)


def _kernels():
    """(module, name, kernel) of every launched `*_kernel` in dsv4/ops/triton."""
    for info in pkgutil.iter_modules(triton_pkg.__path__):
        module = importlib.import_module(f"{triton_pkg.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "fn"):
                yield module, name, obj


def _runtime_ints(kernel) -> list[str]:
    """The kernel's parameters that are not tl.constexpr (constexprs are compile-time by design:
    tile sizes chosen from a bounded set)."""
    return [p.name for p in inspect.signature(kernel.fn).parameters.values() if "constexpr" not in str(p.annotation)]


def _unspecialised(kernel) -> set[str]:
    names = getattr(kernel, "kwargs", {}).get("do_not_specialize") or getattr(kernel, "do_not_specialize", ())
    params = list(inspect.signature(kernel.fn).parameters)
    return {params[n] if isinstance(n, int) else n for n in names}


class _Recorded:
    """kernel[grid](*args, **kw) with every integer argument's value recorded by name."""

    def __init__(self, kernel, name, seen):
        self.kernel, self.name, self.seen = kernel, name, seen
        self.params = list(inspect.signature(kernel.fn).parameters)
        self.runtime = set(_runtime_ints(kernel))

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kw):
            for pname, value in [*zip(self.params, args), *kw.items()]:
                if pname in self.runtime and isinstance(value, int) and not isinstance(value, bool):
                    self.seen[(self.name, pname)].add(value)
            return launch(*args, **kw)
        return run


def _values(model, prompt_len, monkeypatch) -> dict:
    seen = defaultdict(set)
    with monkeypatch.context() as m:
        for module, name, kernel in _kernels():
            m.setattr(module, name, _Recorded(kernel, f"{module.__name__}.{name}", seen))
        eng = LLMEngine("random:tiny", EngineConfig(device="cpu", max_num_batched_tokens=64, max_num_seqs=2,
                                                    num_pages=4), model=model)
        eng.runner.graphs = StepGraphs(model, eng.runner.storage, max_bs=2, capture=False)
        prompt = [(7 * i + 3) % model.cfg.vocab_size for i in range(prompt_len)]
        eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
    return seen


def test_step_dependent_integer_arguments_are_not_specialised(monkeypatch):
    torch.set_num_threads(1)
    for info in pkgutil.iter_modules(ops_pkg.__path__):
        module = importlib.import_module(f"{ops_pkg.__name__}.{info.name}")
        if hasattr(module, "use_triton"):
            monkeypatch.setattr(module, "use_triton", lambda t: True)
    model = build_random_model("random:tiny", overrides=THREE_LAYERS)
    short, long = _values(model, 5, monkeypatch), _values(model, 17, monkeypatch)
    launched = {name.rsplit(".", 1)[1] for name, _ in short}
    assert {"_sparse_attn_kernel", "_scores_kernel", "_norm_rope_kernel", "_pool_kernel"} <= launched, launched
    varying = {key for key in short.keys() | long.keys() if short.get(key) != long.get(key)}
    assert varying, "the two runs should differ in some per-step size"
    unspecialised = {f"{m.__name__}.{name}": _unspecialised(kernel) for m, name, kernel in _kernels()}
    for name, kernel in ((f"{m.__name__}.{n}", k) for m, n, k in _kernels()):
        assert unspecialised[name] <= set(_runtime_ints(kernel)), (name, unspecialised[name])
    missing = sorted((name, p) for name, p in varying if p not in unspecialised[name])
    assert not missing, f"step-dependent integer arguments still specialised: {missing}"
