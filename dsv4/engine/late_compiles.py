"""Triton kernels compiled after the warm-up (docs/architecture.md, Engine: the warm-up compiles
every kernel variant a step can take, so a compile while requests wait is a warm-up gap). After
`ModelRunner.warmup` the engine watches Triton's compile hook: each later compile is logged
with the kernel's specialisation (which constexpr or argument made it new) and counted."""
from __future__ import annotations

import logging

log = logging.getLogger("dsv4.engine")


def _knobs():
    """Triton's runtime knobs (None without Triton or before its knobs, 3.4)."""
    try:
        import triton
    except ImportError:
        return None
    knobs = getattr(triton, "knobs", None)
    return getattr(knobs, "runtime", None)


class LateCompiles:
    """Counts Triton compiles from `install` on, per kernel (bounded: one entry a kernel)."""

    def __init__(self):
        self.kernels: dict[str, int] = {}       # kernel name -> compiles after the warm-up
        self._previous = None
        self._runtime = None

    @property
    def watching(self) -> bool:
        return self._runtime is not None

    @property
    def count(self) -> int:
        return sum(self.kernels.values())

    def install(self) -> bool:
        """Watch compiles from now on (chaining any hook already set); False without Triton's knobs."""
        runtime = _knobs()
        if runtime is None or self._runtime is not None:
            return False
        self._runtime, self._previous = runtime, runtime.jit_cache_hook
        runtime.jit_cache_hook = self.hook
        return True

    def uninstall(self) -> None:
        if self._runtime is not None and self._runtime.jit_cache_hook == self.hook:
            self._runtime.jit_cache_hook = self._previous
        self._runtime = self._previous = None

    def hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        """Triton's `jit_cache_hook`: called before each compile; returning a true value would
        skip it, so this returns what a chained hook returns."""
        name = f"{fn.module}.{fn.name}"
        self.kernels[name] = self.kernels.get(name, 0) + 1
        # and the key: the arguments' (type, specialisation) pairs in order, and the options (Triton
        # 3.6's repr drops the argument types)
        log.warning("Triton compiles %s after the warm-up (%d late compiles so far): %s; key %s", name, self.count,
                    " ".join(str(repr).split()), " ".join(str(key).split()))
        if self._previous is not None:
            return self._previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                  already_compiled=already_compiled)
        return None
