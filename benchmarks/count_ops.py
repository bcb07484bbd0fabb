"""Count the kernels of one padded batch-1 decode step (what the CUDA graph replays), on the CPU.

Every aten op dispatched inside StepGraphs._forward (the second decode step; the first one
warms up) is recorded (TorchDispatchMode) with the
module that issued it; ops that launch no kernel on a GPU (views, empty) are not counted.

    python -m benchmarks.count_ops [--triton] [--spec SPEC] [--context N] [--kv-cache-dtype fp8] [--by-op]

--triton runs the Triton kernels in Triton's interpreter (as on CUDA: every use_triton(...)
op takes its kernel) and counts each kernel launch as one kernel, plus the aten ops around it.
Without it, every op runs its torch reference. The default spec is the V4-Flash layer mix
(compress ratios [0,0,4,128,4,128], hc_mult 4, head_dim 512, rope 64) with small widths.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

SPEC = ("random:flash-slice:6:hidden_size=256,num_attention_heads=4,q_lora_rank=128,o_groups=2,"
        "o_lora_rank=64,moe_intermediate_size=64,n_routed_experts=16,index_n_heads=4,vocab_size=1024")
NO_KERNEL = {"view", "_unsafe_view", "unsqueeze", "squeeze", "expand", "slice", "select", "t", "transpose",
             "permute", "split", "split_with_sizes", "as_strided", "alias", "detach", "empty", "empty_like",
             "empty_strided", "unflatten", "flatten", "unbind", "lift_fresh", "_reshape_alias", "reshape",
             "scalar_tensor"}   # a wrapped Python number: a CPU scalar argument on CUDA


def _category(path: str) -> str:
    if ".indexer.compressor" in path:
        return "indexer compressor"
    for key, name in ((".indexer", "indexer"), (".compressor", "compressor"), ("attn_norm", "norm"),
                      ("ffn_norm", "norm"), (".attn", "attention"), (".ffn.gate", "moe gate"),
                      (".ffn", "moe experts"), ("layers.", "mhc")):
        if key in path:
            return name
    return "embed + head"


class Counter:
    def __init__(self, model):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        self.stack, self.ops, self.in_kernel = ["model"], collections.Counter(), False
        for name, mod in model.named_modules():
            mod.register_forward_pre_hook(lambda m, a, name=name: self.stack.append(f"model.{name}"))
            mod.register_forward_hook(lambda m, a, o: self._leave())
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
                    with self:                                       # count what it runs as
                        out = func.decompose(*args, **(kwargs or {}))
                    if out is not NotImplemented:
                        return out
                name = func.overloadpacket.__name__.rstrip("_")
                if name not in NO_KERNEL and not counter.in_kernel:
                    counter.ops[(_category(counter.stack[-1]), f"aten.{name}")] += 1
                return func(*args, **(kwargs or {}))
        self.mode = Mode()

    def _leave(self) -> None:
        self.stack.pop()                 # (a forward hook's return value would replace the output)

    def count_triton_launches(self):
        from triton.runtime.interpreter import InterpretedFunction
        run = InterpretedFunction.run

        def counted(fn, *args, **kwargs):
            self.ops[(_category(self.stack[-1]), f"triton.{fn.fn.__name__}")] += 1
            self.in_kernel = True             # the interpreter's own tensor traffic is no kernel
            try:
                return run(fn, *args, **kwargs)
            finally:
                self.in_kernel = False
        InterpretedFunction.run = counted


def build_engine(spec: str, context: int, kv_cache_dtype: str = "auto"):
    import torch
    from dsv4.config import EngineConfig
    from dsv4.engine.cuda_graphs import StepGraphs
    from dsv4.engine.engine import LLMEngine
    from dsv4.model.random_model import build_random_model
    from dsv4.bench import offline as bo
    model = build_random_model(spec, "cpu", torch.bfloat16)
    eng = LLMEngine(spec, EngineConfig(dtype="bfloat16", max_num_seqs=1, max_num_batched_tokens=256,
                                       max_model_len=context + 64, num_pages=context // 256 + 4,
                                       enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype),
                    model=model)
    eng.runner.graphs = StepGraphs(model, eng.runner.storage, max_bs=1, capture=False)
    bo._add_batch(eng, 1, context, 8, True, "c")
    return eng


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", default=SPEC)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--triton", action="store_true")
    p.add_argument("--by-op", action="store_true", help="also list every (module, op) count")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    args = p.parse_args()
    if args.triton:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    torch.set_num_threads(1)
    from dsv4.ops import backend
    eng = build_engine(args.spec, args.context, args.kv_cache_dtype)
    if args.triton:
        backend.use_triton = lambda t: True
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("dsv4.") and hasattr(mod, "use_triton"):
                mod.use_triton = backend.use_triton
    graphs = eng.runner.graphs
    eng.step()                        # warm-up, as before a capture (first-use work: fused weights)
    counter = Counter(eng.model)
    if args.triton:
        counter.count_triton_launches()
    forward = graphs._forward

    def counted(fb):
        with counter.mode:
            return forward(fb)
    graphs._forward = counted
    eng.step()
    report(counter.ops, args)


def report(ops: collections.Counter, args) -> None:
    by_cat, by_op = collections.Counter(), collections.Counter()
    for (cat, op), n in ops.items():
        by_cat[cat] += n
        by_op[op] += n
    print(f"kernels per decode step ({'triton' if args.triton else 'reference'} ops, batch 1, "
          f"context {args.context}, KV {args.kv_cache_dtype}): {sum(ops.values())}")
    print("by module: " + ", ".join(f"{c} {n}" for c, n in by_cat.most_common()))
    print("by op:     " + ", ".join(f"{o} {n}" for o, n in by_op.most_common()))
    if args.by_op:
        for (cat, op), n in sorted(ops.items()):
            print(f"  {cat:20s} {op:40s} {n}")


if __name__ == "__main__":
    main()
