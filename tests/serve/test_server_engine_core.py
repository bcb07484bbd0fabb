"""The engine-core loop without processes: intake, forwarding, abort, per-request failure
isolation, stats, and the IPC messages it speaks."""
import os
import threading

import msgspec
import pytest
import torch
import zmq

from dsv4.config import EngineConfig
from dsv4.sampling_params import SamplingParams
from dsv4.engine import ipc
from dsv4.engine.core import EngineCore, _startup_message, ready_message, serve_loop

pytest_plugins = ["serve.server_fixtures"]

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(params=["off", "on"], ids=["sync", "async"])
def core(demo_dir, request):
    from dsv4.engine.engine import LLMEngine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield EngineCore(LLMEngine(demo_dir, EngineConfig(num_pages=8, max_model_len=512, async_scheduling=request.param)))
    torch.set_num_threads(threads)


def add(core, rid, prompt, params=GREEDY):
    core.handle(ipc.AddRequest(rid, prompt, params))


def run(core) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_work:
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def assert_idle(core):
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting, stats.pages_used, stats.swa_pages_used, stats.slots_used) == (0,) * 5
    assert stats.pages_free == 8


def test_outputs_carry_each_token_once_and_finish(core):
    add(core, "a", [5, 6, 7])
    add(core, "b", [9, 10], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2))
    outs = []
    while core.has_work:
        outs += core.step()
    b = [o for o in outs if o.request_id == "b"]
    assert sum(len(o.token_ids) for o in b) == 4 and [o.finished for o in b] == [False] * 3 + [True]
    assert b[-1].finish_reason == "length" and all(len(o.logprobs) == len(o.token_ids) for o in b)
    assert all(o.logprobs[0][0][0] == o.token_ids[0] for o in b)    # the chosen token first
    assert core.stats().generated_tokens == 10 and core.stats().steps > 0
    assert_idle(core)


def test_bad_requests_fail_alone_with_400(core):
    add(core, "ok", [5, 6, 7])
    add(core, "bad-id", [5, 10 ** 6])
    add(core, "too-long", [5] * 10, SamplingParams(max_tokens=600))
    add(core, "ok", [8])   # the id is in use
    failures = {f.request_id: f for f in core.take_failures()}
    assert {f.status for f in failures.values()} == {400} and set(failures) == {"bad-id", "too-long", "ok"}
    assert failures["too-long"].message.startswith("max_tokens:")
    assert run(core)["ok"] and core.take_failures() == []
    assert_idle(core)


def test_abort_frees_everything(core):
    add(core, "a", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
    add(core, "b", [8, 9], SamplingParams(max_tokens=100, ignore_eos=True))
    core.step()
    assert core.stats().pages_used == 2
    core.handle(ipc.AbortRequests(["a", "b", "never-existed"]))
    assert not core.has_work and core.step() == []
    assert_idle(core)


def _fail_for_bad(core, where: str) -> None:
    """Make the engine raise whenever request "bad" is in a step: in the model run once it
    has a token ("execute"), or when the scheduler reserves its pages ("reserve")."""
    if where == "execute":
        obj, name = core.engine.runner, "execute"
        is_bad = lambda chunks, prev=None: any(c.request.request_id == "bad" and c.request.output_token_ids  # noqa: E731
                                               for c in chunks)
    else:
        obj, name = core.engine.cache, "reserve"
        is_bad = lambda req, n: req.request_id == "bad"  # noqa: E731
    real = getattr(obj, name)

    def failing(*args):
        if is_bad(*args):
            raise RuntimeError("kernel fault")
        return real(*args)

    setattr(obj, name, failing)


@pytest.mark.parametrize("where", ["execute", "reserve"])
def test_a_request_failing_inside_the_step_fails_alone(core, where):
    add(core, "x", [5, 6, 7])
    add(core, "y", [8, 9, 10, 11])
    expected = run(core)
    _fail_for_bad(core, where)
    add(core, "x2", [5, 6, 7])
    add(core, "bad", [1, 2, 3])
    add(core, "y2", [8, 9, 10, 11])
    got = run(core)
    (failure,) = core.take_failures()
    assert (failure.request_id, failure.status) == ("bad", 500) and "kernel fault" in failure.message
    assert got["x2"] == expected["x"] and got["y2"] == expected["y"]
    assert len(got.get("bad", [])) == (1 if where == "execute" else 0)
    assert_idle(core)


def test_ready_message_describes_the_engine(core):
    ready = ready_message(core.engine)
    assert ready.max_model_len == 512 and ready.num_pages == 8 and ready.vocab_size == core.engine.cfg.vocab_size
    assert ready.max_request_tokens == 512 and "KV cache" in ready.memory_report
    for line in ("weights:", "routed experts", "C4 entries (CSA)", "fits: 2048 tokens of history"):   # `dsv4 plan`'s report
        assert line in ready.memory_report, line


def test_start_up_failures_name_the_model_and_memory():
    assert _startup_message("/m", FileNotFoundError("no config.json")) == \
        "cannot load model '/m': FileNotFoundError: no config.json"
    for error in (MemoryError(), RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")):
        assert "--cache-memory-gb" in _startup_message("/m", error)


def test_messages_round_trip():
    for message in (ipc.AddRequest("r", [1, 2], SamplingParams(stop=["x"], seed=3, logprobs=2)),
                    ipc.AbortRequests(["r"]), ipc.Shutdown()):
        assert ipc.decode_input(ipc.encode(message)) == message
    out = ipc.StepOutputs([ipc.TokenOutput("r", [3], [[(3, -0.5), (4, -1.5)]], finished=True, finish_reason="stop",
                                           stop_reason="x", final_text="ab")],
                          [ipc.RequestFailed("q", 500, "boom")], ipc.EngineStats(num_running=1))
    for message in (out, ipc.StartupFailed("no"), ipc.Ready(1, 2, None, 3, 4, 5, "m")):
        assert ipc.decode_output(ipc.encode(message)) == message
    with pytest.raises(msgspec.ValidationError):
        ipc.decode_input(ipc.encode(ipc.StartupFailed("wrong direction")))


def test_the_loop_serves_over_sockets_until_shutdown(core):
    addresses = ipc.Addresses.new()
    ctx = zmq.Context()
    try:
        push, pull = ipc.api_sockets(ctx, addresses)
        inbox, outbox = ipc.engine_sockets(ctx, addresses)
        serve_loop(core, inbox, outbox, parent_pid=-1)           # no parent: returns at once
        loop = threading.Thread(target=serve_loop, args=(core, inbox, outbox, os.getppid()))
        loop.start()
        push.send(ipc.encode(ipc.AddRequest("a", [5, 6], GREEDY)))
        tokens, finished = [], False
        while not finished:
            assert pull.poll(30_000), "no output from the engine loop"
            message = ipc.decode_output(pull.recv())
            for out in message.outputs:
                tokens += out.token_ids
                finished = out.finished
        assert len(tokens) == GREEDY.max_tokens and message.stats.num_running == 0
        push.send(ipc.encode(ipc.Shutdown()))
        loop.join(30)
        assert not loop.is_alive()
    finally:
        ctx.destroy(linger=0)
        addresses.remove()
