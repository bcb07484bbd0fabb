"""The grammar worker process (structured/remote.py, worker_proc.py; docs/architecture.md,
"Structured outputs"): outputs identical to the in-process path (`grammar_worker="threads"`)
through every grammar feature, unconstrained neighbours unchanged (invariant 5), speculative
verify masks, no worker without a constrained request, a bad constraint refused at `add`, the
worker's death failing its requests alone, and the worker never outliving the engine."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from dsv4.assets import demo_model_dir
from dsv4.config import ConfigError, EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
KINDS = {"json": StructuredOutputs(json=json.dumps(SCHEMA)), "regex": StructuredOutputs(regex=r"[a-z]{3,6}-[0-9]{2}"),
         "choice": StructuredOutputs(choice=["yes", "no", "maybe"]),
         "grammar": StructuredOutputs(grammar='root ::= "(" [a-z]+ ("," [a-z]+)? ")"')}


@pytest.fixture(scope="module")
def engine_of(demo_engines):
    return lambda **kw: demo_engines(max_num_seqs=64, **kw)


def prompts(eng: LLMEngine, n: int) -> list[list[int]]:
    return [eng.tokenizer.encode(f"Request {i}: describe item number {i * 7} briefly.") for i in range(n)]


def workload(eng: LLMEngine, h) -> list:
    """Every kind (greedy and seeded), the `</think>` gate, grammars ended under ignore_eos, a
    stop string, n = 3 copies of one prompt, unconstrained neighbours and one to abort."""
    ps = prompts(eng, 3)
    think_end = eng.tokenizer.token_to_id("</think>")
    reqs = [h.Req(f"{kind}-{i}", p, SamplingParams(max_tokens=30, temperature=0.0 if i % 2 else 0.9, seed=i,
                                                   structured=spec))
            for kind, spec in KINDS.items() for i, p in enumerate(ps[:2])]
    reqs += [h.Req(f"copy-{i}", ps[0], SamplingParams(max_tokens=24, temperature=0.9, seed=i, structured=KINDS["json"]))
             for i in range(3)]
    reqs += [h.Req("think", ps[1], SamplingParams(max_tokens=12, temperature=0.0, logit_bias={think_end: 100.0},
                                                  structured=StructuredOutputs(choice=["yes", "no"], after_think=True)))]
    reqs += [h.Req(f"ended-{i}", p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                   structured=KINDS["choice"])) for i, p in enumerate(ps[:2])]
    reqs += [h.Req("stopped", ps[2], SamplingParams(max_tokens=20, temperature=0.0, stop=["-"], structured=KINDS["regex"]))]
    reqs += [h.Req(f"plain-{i}", p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
             for i, p in enumerate(ps)]
    reqs += [h.Req("aborted", ps[2], SamplingParams(max_tokens=30, temperature=0.0, structured=KINDS["json"]),
                   arrival=1)]
    return reqs


@pytest.mark.parametrize("mode", ["on", "off"])
def test_worker_outputs_equal_the_in_process_path(engine_of, h, mode):
    """Same outputs from the worker process and the in-process fill, async scheduling `mode`;
    the unconstrained rows give the tokens of a run without any grammar (invariant 5)."""
    inproc, worker = (engine_of(async_scheduling=mode, grammar_worker=w) for w in ("threads", "process"))
    reqs = workload(worker, h)
    outs = {}
    for name, eng in (("threads", inproc), ("process", worker)):
        outs[name] = h.drive(eng, reqs, check=True, abort_at=("aborted", 4))
        assert len(eng.grammars) == 0 and eng.cache.available_pages() == eng.plan.num_pages
    assert type(worker.grammars).__name__ == "WorkerGrammars" and type(inproc.grammars).__name__ == "Grammars"
    h.assert_same_outputs(outs["threads"], outs["process"])
    done = outs["process"]
    assert "aborted" not in done and done["stopped"].stop_reason == "-"
    assert done["think"].token_ids[0] == worker.tokenizer.token_to_id("</think>")
    plain = [r for r in reqs if r.rid.startswith("plain")]
    alone = h.drive(worker, [h.Req("alone-" + r.rid, r.prompt, r.params) for r in plain])
    for r in plain:
        assert done[r.rid].token_ids == alone["alone-" + r.rid].token_ids, r.rid


def test_speculative_verify_masks_through_the_worker(engine_of, h):
    """MTP drafts checked against the worker's grammars (verify masks, rollback): the outputs of
    the in-process path."""
    spec = '{"method": "mtp", "num_speculative_tokens": 3}'
    inproc, worker = (engine_of(speculative_config=spec, grammar_worker=w) for w in ("threads", "process"))
    ps = prompts(worker, 2)
    reqs = [h.Req(f"{kind}-{i}", p, SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 1.0, seed=i,
                                                   structured=s))
            for kind, s in KINDS.items() for i, p in enumerate(ps)]
    h.assert_same_outputs(h.drive(inproc, reqs), h.drive(worker, reqs))
    assert worker.spec.stats.num_draft_tokens > 0 and len(worker.grammars) == 0


def test_no_worker_without_a_constraint_and_bad_ones_refused_at_add(engine_of, h):
    """No worker before the first constrained request; a bad constraint raises at `add`; the
    worker ends when the engine's end of its command pipe closes (the engine gone)."""
    eng = LLMEngine(demo_model_dir(), EngineConfig(num_pages=16, max_num_seqs=8, grammar_worker="process"))
    try:
        h.drive(eng, [h.Req("p", prompts(eng, 1)[0], SamplingParams(max_tokens=4, temperature=0.0))])
        assert eng.grammars is None                 # nothing started, nothing imported for it
        with pytest.raises(ValueError, match="regex"):
            eng.add_request("bad", prompts(eng, 1)[0], SamplingParams(max_tokens=4, structured=StructuredOutputs(regex="a(")))
        assert "bad" not in eng.requests and eng.grammars.get("bad") is None
        out = h.drive(eng, [h.Req("good", prompts(eng, 1)[0], SamplingParams(max_tokens=8, structured=KINDS["choice"]))])
        assert out["good"].text in ("yes", "no", "maybe")
        process = eng.grammars.process
        assert process.is_alive()
        eng.grammars._commands.close()
        process.join(timeout=60)
        assert process.exitcode == 0
    finally:
        eng.close()


def test_masks_match_the_in_process_ones_and_the_buffer_grows(engine_of):
    """`WorkerGrammars` against `registry.Grammars` call for call: a step of more rows than
    the shared buffer holds (grown before the worker has answered once), unconstrained rows,
    a request dropped, and verify masks; then an error inside the worker ends it."""
    from dsv4.structured.registry import Grammars
    from dsv4.structured.remote import WorkerGrammars
    eng = engine_of(async_scheduling="on", grammar_worker="process")
    args = (eng.tokenizer, eng.cfg.vocab_size, eng.eos_token_id)
    inproc, worker = Grammars(*args), WorkerGrammars(*args, rows=2)
    try:
        specs = list(KINDS.values()) + [KINDS["json"]]
        for g in (inproc, worker):
            for i, spec in enumerate(specs):
                g.add(f"r{i}", spec)
        rows = ["r0", "plain", "r1", "r2", "r3", "r4"]
        tokens = {rid: eng.tokenizer.encode(text) for rid, text in
                  zip(["r0", "r1", "r2", "r3", "r4"], ['{"name"', "abc", "ma", "(x", '{"age"'])}
        for step in range(3):
            masks = []
            for g in (inproc, worker):
                taken = [(g.get(rid), ids[step]) for rid, ids in tokens.items() if step < len(ids)]
                mask = g.step_masks(rows, taken if step else []).result()
                masks.append((mask.rows.tolist(), mask.bitmask.clone(), mask.covers_all))
            assert masks[0][0] == masks[1][0] == [0, 2, 3, 4, 5] and not masks[1][2]
            assert torch.equal(masks[0][1], masks[1][1])
        assert worker.buffer.shape[1] >= len(rows)
        for g in (inproc, worker):
            g.drop("r1")
        a, b = (g.verify_masks([("r0", tokens["r0"][3:5]), ("r1", [1]), ("r2", [])]) for g in (inproc, worker))
        assert a.rows.tolist() == b.rows.tolist() and torch.equal(a.bitmask, b.bitmask)
        worker._send(("accept", [999], [1]))       # an error in the worker: told with the next reply
        assert not worker.ping() and "KeyError" in worker.error and "slot 999" in worker.error
        worker.process.join(timeout=30)
        assert worker.process.exitcode == -signal.SIGKILL     # ended: its matchers may be half-way
        assert worker.step_masks(rows).result() is None          # and nothing hangs after
    finally:
        inproc.close()
        worker.close()


def test_worker_death_fails_the_constrained_requests_alone(engine_of, h, monkeypatch):
    """The worker killed mid-run, through the engine core: every constrained request fails with
    500 and the reason (`LLMEngine.failed`), none of its tokens sampled without a mask is
    forwarded, the unconstrained ones finish with their own tokens, nothing hangs; the next
    constrained request gets a fresh worker."""
    from dsv4.engine import ipc
    from dsv4.engine.core import EngineCore
    eng = engine_of(async_scheduling="on", grammar_worker="process")
    monkeypatch.setattr(eng, "make_output", eng.make_output)     # (the core replaces it: put back at the end)
    core = EngineCore(eng)
    ps = prompts(eng, 3)
    plain = {f"plain-{i}": (p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)) for i, p in enumerate(ps)}
    for rid, (p, params) in plain.items():
        core.handle(ipc.AddRequest(rid, p, params))
    for i, p in enumerate(ps):
        core.handle(ipc.AddRequest(f"json-{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                                  structured=KINDS["json"])))
    tokens, steps, failures, killed = {}, 0, [], eng.grammars.process
    while core.has_work:
        if steps == 3:
            os.kill(killed.pid, signal.SIGKILL)
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        failures += core.take_failures()
        steps += 1
        assert steps < 200
    assert sorted(f.request_id for f in failures) == [f"json-{i}" for i in range(3)]
    assert all(f.status == 500 and "grammar worker process exited (code -9)" in f.message for f in failures)
    import xgrammar
    from dsv4.structured.compiler import GrammarCache
    compiled = GrammarCache(eng.tokenizer, eng.cfg.vocab_size, eng.eos_token_id).get(KINDS["json"])
    for i in range(3):                      # every token forwarded was sampled under the mask
        matcher = xgrammar.GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in tokens.get(f"json-{i}", []))
    eng.make_output = eng.output_of         # (the engine's own outputs again)
    alone = h.drive(eng, [h.Req("alone-" + rid, p, params) for rid, (p, params) in plain.items()])
    for rid in plain:
        assert tokens[rid] == alone["alone-" + rid].token_ids
    assert len(eng.grammars) == 0 and eng.cache.available_pages() == eng.plan.num_pages
    out = h.drive(eng, [h.Req("after", ps[0], SamplingParams(max_tokens=8, structured=KINDS["choice"]))])
    assert out["after"].text in ("yes", "no", "maybe") and eng.grammars.process is not killed


def test_a_hung_worker_is_killed_and_its_requests_fail(engine_of, h, monkeypatch):
    """A worker that stops answering (SIGSTOP) is killed after REPLY_TIMEOUT_S; its requests
    fail with that reason, the others finish."""
    from dsv4.structured import remote
    eng = engine_of(async_scheduling="on", grammar_worker="process")
    eng._grammars().ping()                  # (a fresh worker, started: not timed out while importing)
    monkeypatch.setattr(remote, "REPLY_TIMEOUT_S", 0.5)
    os.kill(eng.grammars.process.pid, signal.SIGSTOP)
    ps = prompts(eng, 2)
    done = h.drive(eng, [h.Req("plain", ps[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)),
                         h.Req("json", ps[1], SamplingParams(max_tokens=8, temperature=0.0, structured=KINDS["json"]))])
    assert eng.take_failed() == [("json", "the grammar worker process did not answer within 0.5 s (killed)")]
    assert done["plain"].finish_reason == "length" and done["json"].finish_reason == "abort"
    assert eng.grammars.process.exitcode == -signal.SIGKILL


def test_grammar_worker_knob(monkeypatch):
    with pytest.raises(ConfigError, match="grammar_worker"):
        EngineConfig(grammar_worker="fork")
    assert EngineConfig(grammar_worker="process").grammar_process
    assert not EngineConfig(grammar_worker="threads").grammar_process
    for cores, process in ((2, False), (16, True)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
        assert EngineConfig().grammar_process is process
