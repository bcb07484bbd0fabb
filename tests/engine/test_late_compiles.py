"""Triton compiles after the warm-up are logged and counted per kernel (engine/late_compiles.py):
the watcher sits in Triton's `jit_cache_hook` (called as Triton calls it: keywords of its
JITHook protocol), chains a hook set before it, and `uninstall` restores that one."""
import logging

import pytest

from dsv4.engine.late_compiles import LateCompiles


@pytest.fixture
def triton():
    """Triton, imported when the test runs, never at collection: tests/ops_triton/conftest.py must
    set TRITON_INTERPRET before anything imports Triton (its kernels read it when defined)."""
    return pytest.importorskip("triton")


def _compile(hook, name):
    from triton.runtime.jit import JitFunctionInfo
    return hook(key=f"{name}-key", repr=f"{name}[num_warps=4](T: i32, BLOCK: constexpr = 64)",
                fn=JitFunctionInfo("dsv4.ops.triton.x", name, None), compile={}, is_manual_warmup=False,
                already_compiled=False)


def test_counts_logs_chains_and_restores(caplog, monkeypatch, triton):
    runtime = triton.knobs.runtime
    seen = []
    previous = lambda **kw: seen.append(kw["key"])       # noqa: E731  a hook set before (returns None)
    monkeypatch.setattr(runtime, "jit_cache_hook", previous)
    late = LateCompiles()
    assert late.install() and late.watching and runtime.jit_cache_hook == late.hook
    assert not late.install()                              # once
    with caplog.at_level(logging.WARNING, logger="dsv4.engine"):
        assert _compile(runtime.jit_cache_hook, "_a_kernel") is None    # None: Triton goes on compiling
        _compile(runtime.jit_cache_hook, "_b_kernel")
        _compile(runtime.jit_cache_hook, "_a_kernel")
    assert late.kernels == {"dsv4.ops.triton.x._a_kernel": 2, "dsv4.ops.triton.x._b_kernel": 1}
    assert late.count == 3 and seen == ["_a_kernel-key", "_b_kernel-key", "_a_kernel-key"]
    assert "BLOCK: constexpr = 64" in caplog.text and "3 late compiles" in caplog.text
    assert "key _b_kernel-key" in caplog.text                 # the specialisation, which 3.6's repr drops
    late.uninstall()
    assert runtime.jit_cache_hook is previous and not late.watching


def test_cpu_warmup_does_not_watch(tiny, one_thread):
    """The watcher goes on only on CUDA (the interpreter never compiles)."""
    eng = tiny.engine(max_num_batched_tokens=8, max_num_seqs=2, num_pages=8, max_model_len=64)
    eng.warmup()
    assert not eng.runner.late_compiles.watching


def test_close_takes_the_watcher_off(tiny, one_thread, triton, monkeypatch):
    """An engine's close uninstalls its watcher: another engine's warm-up in the same process
    (a benchmark's next case) is not counted late."""
    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "jit_cache_hook", None)
    eng = tiny.engine(max_num_batched_tokens=8, max_num_seqs=2, num_pages=8, max_model_len=64)
    assert eng.runner.late_compiles.install() and runtime.jit_cache_hook == eng.runner.late_compiles.hook
    eng.close()
    assert runtime.jit_cache_hook is None and not eng.runner.late_compiles.watching
