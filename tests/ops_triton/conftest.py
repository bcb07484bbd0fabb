"""Triton kernels run here in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported), against their torch references in dsv4/ops. On
the GPU machine the same tests run compiled (`DSV4_TRITON_DEVICE=cuda`)."""
import inspect
import os

import pytest

pytest.importorskip("triton", reason="triton is part of the test extra")


def _skip_repatching_in_device_calls() -> None:
    """The interpreter patches triton.language (tl.load, tl.sum, ... -> numpy) for a launch and
    restores it after; it also re-patches it on every call of a @triton.jit helper inside a
    kernel (a few ms each: inspect.getmembers over tl, tl.tensor, tl.math), per program, which
    is a third of the run time of kernels that call helpers. Such a call here patches only
    when one of its language modules is not patched yet (its `load` still the builtin): the
    same patched modules, the same results; launches are untouched."""
    from triton.runtime import interpreter as ti
    import triton.language as tl

    call = ti.InterpretedFunction.__call__
    if "_patch_lang(self.fn)" not in inspect.getsource(call):     # another Triton: leave it as it is
        return
    langs_of: dict = {}

    def unpatched(fn) -> bool:
        key = (fn, len(fn.__globals__))     # a rewrite adds the interpreter's globals to the module's
        langs = langs_of.get(key)
        if langs is None:
            langs = langs_of[key] = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        return not langs or any(tl.core.is_builtin(lang.load) for lang in langs)

    def device_call(self, *args, **kwargs):
        if unpatched(self.fn):
            ti._patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.InterpretedFunction.__call__ = device_call


def _skip_discarded_overflow_checks() -> None:
    """Integer +, -, * in the interpreter first redo the operation in int64 and compare it with
    the type's range (`sanitize_overflow`, on by default), then hand the result to
    device_assert, which drops it unless the options' `debug` is set (it is not): two casts, an
    operation, two comparisons and an `and` per integer operation, per program, for nothing
    (two fifths of an FP8 MoE decode kernel's time). Off while debug is off: the same values,
    the same (absent) assertions."""
    import dataclasses

    from triton.runtime import interpreter as ti

    builder = getattr(ti, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or getattr(options, "debug", True) or not getattr(options, "sanitize_overflow", False):
        return       # another Triton, or asserts that would fire: leave it as it is
    builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _np_dtypes_from_a_table() -> None:
    """The interpreter maps a Triton dtype to its numpy storage dtype (`_get_np_dtype`) several
    times per operation, per program, building a 19-entry dict of np.dtype objects on every call
    (a twelfth of the row top-k kernels' time). Here each dtype's answer is the interpreter's
    own, computed once and kept: the same numpy dtypes, and an unknown dtype still raises there."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    original = getattr(ti, "_get_np_dtype", None)
    if original is None:
        return                                    # another Triton: leave it as it is
    table: dict = {}
    uint64 = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return uint64
        found = table.get(tt_dtype)
        if found is None:
            found = table[tt_dtype] = original(tt_dtype)
        return found

    ti._get_np_dtype = get_np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _skip_repatching_in_device_calls()
    _skip_discarded_overflow_checks()
    _np_dtypes_from_a_table()


@pytest.fixture
def device():
    return os.environ.get("DSV4_TRITON_DEVICE", "cpu")
