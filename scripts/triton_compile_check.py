"""Compile every Triton kernel the kernel tests launch for an H200 (sm_90), without a GPU.

The interpreter (how tests/ops_triton runs on a CPU) accepts code that the compiler rejects,
and the GPU machine's Triton may be older than this one's. Run with the GPU's Triton version
installed in a side environment (e.g. /tmp/t36 with triton==3.6.0 and the CPU torch):

    /tmp/t36/bin/python -m scripts.triton_compile_check [pytest args, default tests/ops_triton]

Phase 1 runs the tests in the interpreter and records each kernel launch (argument dtypes,
constexpr values, num_warps/num_stages). Phase 2, in a fresh process without the
interpreter, compiles each distinct launch with triton.compile for sm_90. Exit 1 on any failure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

TYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.int64": "i64",
         "torch.int32": "i32", "torch.bool": "i1", "torch.uint8": "u8", "torch.int8": "i8",
         "torch.float8_e4m3fn": "fp8e4nv"}
OPTIONS = ("num_warps", "num_stages")
SM90_SHARED_BYTES = 232448          # an H100 / H200 block's opt-in shared memory


def record(out_path: str, pytest_args: list[str]) -> int:
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    import torch
    from triton.runtime.interpreter import InterpretedFunction
    seen: dict[str, dict] = {}
    run = InterpretedFunction.run

    from triton.tools.tensor_descriptor import TensorDescriptor

    def describe(value):
        if isinstance(value, TensorDescriptor):     # a host TMA descriptor: its dtype and block
            return {"desc": f"{TYPES[str(value.base.dtype)]}{list(value.block_shape)}"}
        if isinstance(value, torch.Tensor):
            return {"ptr": TYPES[str(value.dtype)]}
        if isinstance(value, bool):
            return {"const": value}
        if isinstance(value, int):
            return {"int": value}
        if isinstance(value, float):
            return {"float": value}
        if value is None:
            return {"const": None}
        return {"repr": str(value)}               # tl.dtype and the like: constexpr only

    def spy(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        launch = {"module": self.fn.__module__, "name": self.fn.__name__,
                  "dir": os.path.dirname(os.path.abspath(self.fn.__code__.co_filename)),
                  "args": {k: describe(v) for k, v in values.items()},
                  "options": {k: kwargs[k] for k in OPTIONS if k in kwargs}}
        seen.setdefault(json.dumps(launch, sort_keys=True), launch)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = spy
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args])
    with open(out_path, "w") as f:
        json.dump(list(seen.values()), f)
    return int(rc)


def compile_all(in_path: str) -> int:
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    with open(in_path) as f:
        launches = json.load(f)
    failures = 0
    for launch in launches:
        if "." not in launch["module"] and launch["dir"] not in sys.path:   # a test file's kernel: by its folder
            sys.path.append(launch["dir"])
        fn = getattr(importlib.import_module(launch["module"]), launch["name"])
        fn = getattr(fn, "fn", fn) if not isinstance(fn, triton.runtime.JITFunction) else fn
        consts = {p.name for p in fn.params if p.is_constexpr}
        sig, constexprs = {}, {}
        for name in fn.arg_names:
            d = launch["args"].get(name)
            if d is None:
                continue                              # a default left to the kernel
            if name in consts or "const" in d or "repr" in d:
                value = d.get("const", d.get("int", d.get("float")))
                if "repr" in d:
                    value = getattr(tl, d["repr"].replace("tl.", ""), None) or _dtype(d["repr"])
                sig[name], constexprs[name] = "constexpr", value
            elif "ptr" in d:
                sig[name] = "*" + d["ptr"]
            elif "desc" in d:
                sig[name] = f"tensordesc<{d['desc']}>"
            elif "int" in d:
                sig[name] = "i64" if abs(d["int"]) >= 2**31 else "i32"
            else:
                sig[name] = "fp32"
        try:
            kernel = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                                    options=launch["options"])
            if kernel.metadata.shared > SM90_SHARED_BYTES:   # the launch, not the compile, would fail
                raise RuntimeError(f"shared memory {kernel.metadata.shared} > {SM90_SHARED_BYTES} bytes")
            print(f"ok   {launch['module']}.{launch['name']} {launch['options']}")
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"FAIL {launch['module']}.{launch['name']} {launch['options']}: "
                  f"{type(e).__name__}: {str(e)[-1500:]}")
    print(f"{len(launches)} launches compiled, {failures} failed")
    return 1 if failures else 0


def _dtype(text: str):
    import triton.language as tl
    return {str(t): t for t in (tl.float32, tl.bfloat16, tl.float16, tl.int32, tl.int64)}.get(text, text)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--compile":
        return compile_all(sys.argv[2])
    path = os.path.join(tempfile.mkdtemp(), "launches.json")
    env = {**os.environ, "DSV4_TRITON_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    code = f"import sys; from scripts import triton_compile_check as t; " \
           f"sys.exit(t.record({path!r}, {sys.argv[1:] or ['tests/ops_triton']!r}))"
    rc = subprocess.run([sys.executable, "-c", code], env=env).returncode
    if rc not in (0, 1):
        print(f"the tests could not run (pytest exit {rc})")
        return 1
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "scripts.triton_compile_check", "--compile", path], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
