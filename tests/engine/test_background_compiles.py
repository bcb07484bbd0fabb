"""Grammar compiles off the step path (docs/architecture.md, "Structured outputs"): while a
constraint's compile is held (blocked on an Event), the unconstrained requests of the same
engine run and finish with their own tokens and the constrained one waits unscheduled; once
released its output validates and equals its output with the grammar ready at once. An
abort during the compile leaks nothing; a constraint its compile refuses fails alone."""
from __future__ import annotations

import threading
import time

import pytest

from dsv4.engine import ipc
from dsv4.engine.core import EngineCore
from dsv4.engine.request import Status
from dsv4.sampling_params import SamplingParams, StructuredOutputs
from dsv4.structured import grammars as grammars_mod
from dsv4.structured.compiler import GrammarCache

CHOICES = ["alpha", "beta", "gamma"]
SLOW = StructuredOutputs(choice=CHOICES)        # its compile is held by the test


@pytest.fixture(scope="module")
def eng(demo_engines):
    return demo_engines(max_num_seqs=8, async_scheduling="on")


@pytest.fixture
def held(monkeypatch):
    """SLOW's compile blocks until `release` is set; -> (started, release) Events."""
    started, release, real_get = threading.Event(), threading.Event(), GrammarCache.get

    def get(cache, spec):
        if spec.key() == SLOW.key() and cache.lookup(spec) is None:
            started.set()
            assert release.wait(120)
        return real_get(cache, spec)
    monkeypatch.setattr(GrammarCache, "get", get)
    yield started, release
    release.set()


@pytest.fixture(params=["in-process", "worker"])
def registry(request, eng):
    """A fresh registry on `eng` (nothing cached): the in-process one, or the grammar worker's
    loop on a thread of this process (remote.WorkerGrammars(in_thread=True): the same pipes and
    commands, and the test's hold reaches its compile)."""
    from dsv4.structured.registry import Grammars
    from dsv4.structured.remote import WorkerGrammars
    args = (eng.tokenizer, eng.cfg.vocab_size, eng.eos_token_id)
    grammars = Grammars(*args) if request.param == "in-process" else WorkerGrammars(*args, rows=8, in_thread=True)
    eng.grammars = grammars
    yield grammars
    grammars.close()
    eng.grammars = None


def prompts(eng, n: int) -> list[list[int]]:
    return [eng.tokenizer.encode(f"Request {i}: describe item number {i * 7} briefly.") for i in range(n)]


def plain_params() -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def constrained_params() -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=0.9, seed=3, structured=SLOW)


def test_a_held_compile_holds_up_no_other_request(eng, h, held, registry):
    started, release = held
    ps = prompts(eng, 3)
    alone = h.drive(eng, [h.Req(f"ref-{i}", p, plain_params()) for i, p in enumerate(ps[:2])])
    eng.add_request("slow", ps[2], constrained_params())
    assert eng.requests["slow"].grammar_pending and started.wait(120)
    for i, p in enumerate(ps[:2]):
        eng.add_request(f"plain-{i}", p, plain_params())
    done, steps = {}, 0
    while len(done) < 2:                            # the compile is held all along
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        steps += 1
        assert steps < 200
    assert not release.is_set()
    for i in range(2):
        assert done[f"plain-{i}"].token_ids == alone[f"ref-{i}"].token_ids
    slow = eng.requests["slow"]
    assert slow.grammar_pending and slow.status is Status.WAITING and slow.num_computed == 0
    assert not slow.output_token_ids and eng.cache.seq(slow).holds_nothing
    release.set()
    out = h.drive(eng)["slow"]
    assert out.text in CHOICES and out.finish_reason == "stop"
    eng.add_request("ready", ps[2], constrained_params())      # compiled now (the worker: noticed at once)
    assert eng.requests["ready"].grammar_pending is hasattr(registry, "ping")
    assert h.drive(eng)["ready"].token_ids == out.token_ids
    assert len(eng.grammars) == 0 and eng.cache.available_pages() == eng.plan.num_pages


def test_abort_while_compiling_leaks_nothing(eng, h, held, registry):
    started, release = held
    ps = prompts(eng, 2)
    eng.add_request("slow", ps[0], constrained_params())
    eng.add_request("plain", ps[1], plain_params())
    assert started.wait(120)
    eng.step()
    eng.abort("slow")
    assert "slow" not in eng.requests and not eng._compiling and len(eng.grammars) == 0
    release.set()                                   # its result comes back after the abort: dropped
    done = h.drive(eng, [h.Req("after", ps[0], SamplingParams(max_tokens=8, structured=StructuredOutputs(
        choice=["yes", "no"])))])
    assert set(done) == {"plain", "after"} and done["after"].text in ("yes", "no")
    assert len(eng.grammars) == 0 and eng.grammars.get("slow") is None
    assert eng.cache.available_pages() == eng.plan.num_pages
    if hasattr(eng.grammars, "ping"):               # the worker answers, nothing left compiling
        assert eng.grammars.ping() and not eng.grammars._compiling
    else:
        assert not eng.grammars._compiling and not eng.grammars._requests


@pytest.mark.parametrize("mode", ["threads", "process"])
def test_a_constraint_its_compile_refuses_fails_alone(demo_engines, h, mode):
    """Over CHECK_AT_ADD_CHARS, a bad constraint is found by its compile: that request fails
    with 400 and the error a check at `add` gives; the others run on with their own tokens."""
    eng = demo_engines(max_num_seqs=8, async_scheduling="on", grammar_worker=mode)
    bad = StructuredOutputs(regex="(" + "a" * grammars_mod.CHECK_AT_ADD_CHARS)
    with pytest.raises(grammars_mod.GrammarError) as expected:
        grammars_mod.build_checked(bad)
    ps = prompts(eng, 3)
    alone = h.drive(eng, [h.Req(f"ref-{i}", p, plain_params()) for i, p in enumerate(ps[:2])])
    core = EngineCore(eng)
    try:
        core.handle(ipc.AddRequest("bad", ps[2], SamplingParams(max_tokens=8, structured=bad)))
        for i, p in enumerate(ps[:2]):
            core.handle(ipc.AddRequest(f"plain-{i}", p, plain_params()))
        core.handle(ipc.AddRequest("good", ps[2], SamplingParams(max_tokens=8, structured=StructuredOutputs(
            choice=["yes", "no"]))))
        # a step waits COMPILE_WAIT_S at most for compiles (the worker's, slower on a loaded host):
        # a guard by time, not by steps
        tokens, failures, deadline = {}, [], time.monotonic() + 300
        while core.has_work:
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
            failures += core.take_failures()
            assert time.monotonic() < deadline, "the requests did not finish"
    finally:
        eng.make_output = eng.output_of
    assert [(f.request_id, f.status, f.message) for f in failures] == [("bad", 400, str(expected.value))]
    assert "bad" not in tokens and "bad" not in eng.requests
    for i in range(2):
        assert tokens[f"plain-{i}"] == alone[f"ref-{i}"].token_ids
    assert eng.tokenizer.decode(tokens["good"], skip_special_tokens=True) in ("yes", "no")
    assert len(eng.grammars) == 0 and eng.cache.available_pages() == eng.plan.num_pages


def test_an_id_added_again_after_an_abort_gets_its_own_grammar(eng, h, held, registry):
    """The old compile, coming back after its request was aborted and its id reused for another
    constraint, is not taken for the new one."""
    started, release = held
    ps = prompts(eng, 1)
    eng.add_request("r", ps[0], constrained_params())
    assert started.wait(120)
    eng.abort("r")
    other = StructuredOutputs(choice=["yes", "no"])
    eng.add_request("r", ps[0], SamplingParams(max_tokens=8, structured=other))
    release.set()
    assert h.drive(eng)["r"].text in ("yes", "no")
    assert len(eng.grammars) == 0
