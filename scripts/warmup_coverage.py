"""Which Triton kernel variants a served workload compiles that the warm-up did not, without a
GPU: every op on its Triton kernel in the interpreter, each launch's specialisation key taken as
Triton's JIT takes it (constexprs, dtypes, 16-byte pointer alignment, integers == 1 or % 16
unless `do_not_specialize`, num_warps / num_stages), first during `LLMEngine.warmup`, then
during a workload of staggered requests (chunked prefills mixed with decodes). Prints every
key first met after the warm-up, as its difference from the nearest warmed key (docs/architecture.md,
Engine: on a GPU those are compiles while requests wait; engine/late_compiles.py logs them there).

    python -m scripts.warmup_coverage [--model random:tiny] [--budget 64] [--prompts 70,33,5,130]

Slow (the interpreter runs every kernel: ~11 minutes for the defaults on the 2-core host). Exit 1
when a key is late. radix_topk's ROWS exists only in the interpreter (1 on a GPU, where no late
key can come from it); on the defaults it is the only late key (ROWS = 1, 2026-12-01).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import pkgutil
import sys

os.environ["TRITON_INTERPRET"] = "1"


def launch_key(kernel, args, kwargs) -> tuple:
    """(kernel name, ((parameter, specialisation), ...), options) as Triton's JIT keys a launch."""
    import torch
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    unspecialised = set(kernel.kwargs.get("do_not_specialize") or ())
    params = list(inspect.signature(kernel.fn).parameters.values())
    values = dict(zip((p.name for p in params), args)) | kwargs
    spec = []
    for p in params:
        v = values.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            spec.append((p.name, repr(v)))
        elif isinstance(v, torch.dtype):
            spec.append((p.name, str(v)))
        else:
            spec.append((p.name, native_specialize_impl(BaseBackend, v, False, p.name not in unspecialised, True)))
    options = tuple((k, kwargs[k]) for k in ("num_warps", "num_stages") if k in kwargs)
    return f"{kernel.fn.__module__}.{kernel.fn.__name__}", tuple(spec), options


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--budget", type=int, default=64, help="max_num_batched_tokens")
    p.add_argument("--prompts", default="70,33,5,130", help="prompt lengths, one request added a step")
    p.add_argument("--max-tokens", type=int, default=6)
    args = p.parse_args(argv)
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    import dsv4.ops as ops_pkg
    from dsv4.config import EngineConfig
    from dsv4.engine.engine import LLMEngine
    from dsv4.model.weights import load_model
    from dsv4.sampling_params import SamplingParams

    phase, first_seen = ["warm-up"], {}
    run = InterpretedFunction.run

    def recorded(self, *a, grid, warmup, **kw):
        first_seen.setdefault(launch_key(self, a, kw), phase[0])
        return run(self, *a, grid=grid, warmup=warmup, **kw)

    InterpretedFunction.run = recorded
    torch.set_num_threads(1)
    for info in pkgutil.iter_modules(ops_pkg.__path__):          # every op on its Triton kernel
        module = importlib.import_module(f"{ops_pkg.__name__}.{info.name}")
        if hasattr(module, "use_triton"):
            module.use_triton = lambda t: True
    model = load_model(args.model, "cpu")
    eng = LLMEngine(args.model, EngineConfig(device="cpu", max_num_batched_tokens=args.budget, max_num_seqs=4,
                                             num_pages=16), model=model)
    print("warm-up:", eng.warmup(), flush=True)
    phase[0] = "served"
    vocab = model.cfg.vocab_size
    for i, n in enumerate(int(x) for x in args.prompts.split(",")):
        eng.add_request(f"r{i}", [(7 * j + 3 + i) % vocab for j in range(n)],
                        SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
        eng.step()
    while eng.has_unfinished():
        eng.step()
    warm: dict[str, list] = {}
    for (name, spec, options), seen in first_seen.items():
        if seen == "warm-up":
            warm.setdefault(name, []).append((spec, options))
    late = [(name, spec, options) for (name, spec, options), seen in first_seen.items() if seen == "served"]
    for name, spec, options in late:
        nearest = min(warm.get(name, []), key=lambda w: sum(a != b for a, b in zip(w[0], spec)), default=None)
        diff = spec if nearest is None else [(a, b[1]) for a, b in zip(spec, nearest[0]) if a != b]
        print(f"LATE {name}: {diff} {options}")
    print(f"{len(first_seen) - len(late)} variants at warm-up, {len(late)} first met after it")
    return 1 if late else 0


if __name__ == "__main__":
    sys.exit(main())
