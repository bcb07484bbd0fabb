"""Which implementation of the ops runs: the torch reference (the definition; CPU and GPU)
or the Triton kernels (CUDA only). Chosen once per engine (`EngineConfig.ops_backend`):
  "auto"      Triton where a kernel exists and the tensors are on a CUDA device;
  "reference" always the torch reference (what the kernels are checked against).
"""
from __future__ import annotations

import contextlib
import importlib.util

BACKENDS = ("auto", "reference")
_state = {"backend": "auto"}
HAS_TRITON = importlib.util.find_spec("triton") is not None


def set_backend(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"ops_backend: expected one of {BACKENDS}, got {name!r}")
    _state["backend"] = name


def get_backend() -> str:
    return _state["backend"]


def use_triton(tensor) -> bool:
    """True when the Triton kernel should run for an op on `tensor`."""
    return _state["backend"] == "auto" and HAS_TRITON and tensor.is_cuda


@contextlib.contextmanager
def forced(name: str):
    """Run a block with another backend (e.g. "reference" to compute a kernel's definition)."""
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)
