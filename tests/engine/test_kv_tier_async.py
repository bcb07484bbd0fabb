"""The tiers' copies run beside the steps, never in them (docs/architecture.md, "Host and disk
tiers"): with the mover on a side stream whose events complete only some steps later
(tier_streams.py), an engine offloads a long prompt's pages and later restores them from the host
while four other requests decode. The step's thread never waits for a copy (no event is
synchronized), the other requests keep producing tokens while the restore is in flight, and
every request's greedy tokens equal a plain engine's (invariant 5)."""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.cache.tiers.executors import make_executor
from dsv4.cache.tiers.movers import Mover
from dsv4.sampling_params import SamplingParams
from tier_streams import DeferredStreams

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = dict(temperature=0.0, ignore_eos=True)


class Ops(TorchDispatchMode):
    """The torch operators run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def run(eng, prompts: dict[str, list[int]], max_tokens: dict[str, int], streams=None, on_step=None) -> dict:
    for rid, prompt in prompts.items():
        eng.add_request(rid, list(prompt), SamplingParams(max_tokens=max_tokens[rid], **GREEDY))
    out = {rid: [] for rid in prompts}
    tiers = eng.cache.tiers
    for _ in range(5000):                 # a stuck engine fails instead of hanging
        if not eng.has_unfinished():
            return out
        got = eng.step()
        for o in got:
            out[o.request_id] += o.new_token_ids
        if on_step is not None:
            on_step(got)
        if streams is not None:
            streams.fire()
        if not got and tiers is not None:   # nothing to step: let a mover thread issue what it was asked
            for job in [*tiers.stores, *tiers.loads.values()]:
                job.ticket.future.result(timeout=60)
    raise AssertionError("the engine did not finish")


FIRST_LENGTHS = {"long": 4, **{f"d{i}": 40 for i in range(4)}}
AGAIN_LENGTHS = {"again": 8, **{f"d{i}": 30 for i in range(4)}}


def first_prompts(tiny) -> dict[str, list[int]]:
    """A long prompt (pages of 256, 512, 768 offloaded) and four short ones that decode beside it."""
    return {"long": tiny.tie_free_ids(900, seed=611), **{f"d{i}": tiny.ids(60 + 7 * i, seed=620 + i) for i in range(4)}}


def again_prompts(first: dict[str, list[int]], outputs: dict[str, list[int]]) -> dict[str, list[int]]:
    """The long prompt's first 800 tokens again; the short ones continued with their answers."""
    return {"again": first["long"][:800], **{rid: p + outputs[rid] for rid, p in first.items() if rid != "long"}}


@pytest.fixture(scope="module")
def plain_outputs(tiny) -> tuple[dict, dict]:
    """A plain engine's (no prefix cache, no tiers) greedy tokens for both phases of
    test_offload_and_restore_beside_decodes_never_wait, shared by its parameters."""
    plain = tiny.engine(max_num_batched_tokens=256, max_num_seqs=6, num_pages=60, enable_prefix_caching=False)
    prompts = first_prompts(tiny)
    first = run(plain, prompts, FIRST_LENGTHS)
    return first, run(plain, again_prompts(prompts, first), AGAIN_LENGTHS)


@pytest.mark.parametrize("threaded", [False, True])
def test_offload_and_restore_beside_decodes_never_wait(tiny, plain_outputs, threaded):
    """`threaded`: the mover issues its copies from a thread of its own, as when serving."""
    prompts = first_prompts(tiny)
    eng = tiny.engine(max_num_batched_tokens=256, max_num_seqs=6, num_pages=60, host_cache_gb=0.02)
    streams = DeferredStreams(random.Random(3))
    tiers = eng.cache.tiers
    tiers.mover = Mover(streams, tiers.codec, make_executor(threaded, "test-mover"))
    plain_first, plain_again = plain_outputs

    # 1. the long prompt prefills (offloading 256, 512, 768) while the others decode
    first = run(eng, prompts, FIRST_LENGTHS, streams)
    assert first == plain_first
    assert tiers.stats.bytes["gpu_to_host"] > 0
    assert streams.waits == 0

    # 2. the GPU forgets; the prompt comes back while the others decode: it waits for its
    # restore from the host, steps go on meanwhile, and it resumes at 768
    for job in tiers.stores:
        job.ticket.future.result()        # issued (by the mover's thread, when threaded)
    for _ in range(30):
        streams.fire()
    tiers.poll()
    assert not tiers.stores
    eng.reset_prefix_cache()
    decoded_while_waiting = []

    def watch(outputs):
        if tiers.loads:
            decoded_while_waiting.extend(t for o in outputs if o.request_id != "again" for t in o.new_token_ids)
    second = run(eng, again_prompts(prompts, first), AGAIN_LENGTHS, streams, watch)
    assert second == plain_again
    assert tiers.stats.hit_tokens["host"] == 768
    assert decoded_while_waiting, "no step ran while the restore was in flight"
    assert streams.waits == 0, "the step's thread waited for a tier copy"
    tiers.close()
    assert not tiers.busy


@pytest.mark.parametrize("threaded", [False, True])
def test_a_store_issues_the_same_work_for_any_number_of_pages(tiny, threaded):
    """What is launched per offload does not grow with the prefix's pages (one gather per kind,
    coalesced host copies), and none of it reads a device value back; with the mover on its own
    thread (as when serving) the step's thread launches one operator per offload: the tail's clone."""
    eng = tiny.engine(max_num_batched_tokens=256, max_num_seqs=2, num_pages=60, host_cache_gb=0.02)
    tiers = eng.cache.tiers
    tiers.mover = Mover(tiers.mover.streams, tiers.codec, make_executor(threaded, "test-mover"))
    counts = []
    for n in (1, 3, 7):
        tokens = tiny.ids(256 * n, seed=700 + n)
        pages = eng.cache.pages.allocate(n)
        for i, p in enumerate(pages):
            for kind in ("c4", "idx", "c128"):
                eng.runner.storage.page(kind, p).copy_(torch.randn(eng.runner.storage.page(kind, p).shape))
        with Ops() as ops:
            tiers.offload(tokens, pages, 256 * n, eng.runner.storage.checkpoints[0])
        assert not any(name.startswith(("_local_scalar_dense", "item")) for name in ops.names), ops.names
        counts.append(len(ops.names))
        if threaded:                  # views of the checkpoint rows, and the clone of the tail
            assert sorted(name.split(".")[0] for name in ops.names) == ["clone", "select", "select"], ops.names
        tiers.drain()
        rows = tiers.host.pages.rows[[tiers.host.pages.index[k].slot for k in tiers.keys(tokens, n)]]
        for p, row in zip(pages, rows, strict=True):
            assert torch.equal(row, torch.cat([eng.runner.storage.page(k, p).reshape(-1)
                                               for k in ("c4", "idx", "c128")]))
        eng.cache.pages.free(pages)
    assert counts[0] == counts[1] == counts[2], counts
    tiers.close()


def test_a_slow_disk_read_does_not_hold_up_other_requests(tiny, tmp_path, monkeypatch):
    """A restart finds a prompt's prefix on disk only; its file read (on the disk thread) is held
    until the test lets it go. Meanwhile four other requests are admitted, decode and finish; the
    step's thread never waits for the read. Then the read completes (collecting it runs no
    torch operator: the disk thread read the file into the host rows), the prompt resumes at 768
    from the disk tier, and every request's greedy tokens equal a plain engine's (invariant 5)."""
    import threading

    from dsv4.cache.tiers import disk as disk_module
    long = tiny.tie_free_ids(900, seed=631)
    others = {f"d{i}": tiny.ids(60 + 7 * i, seed=640 + i) for i in range(4)}
    cfg = dict(max_num_batched_tokens=256, max_num_seqs=6, num_pages=60, host_cache_gb=0.02,
               disk_cache_dir=str(tmp_path), disk_cache_gb=1)
    first = tiny.engine(**cfg)
    run(first, {"first": long}, {"first": 2})
    first.cache.tiers.close()

    gate, read_file = threading.Event(), disk_module.read_file

    def held(*args):
        assert gate.wait(timeout=60), "the test never released the read"
        return read_file(*args)
    monkeypatch.setattr(disk_module, "read_file", held)
    eng = tiny.engine(**cfg)
    tiers = eng.cache.tiers
    tiers.executor = tiers.disk.executor = make_executor(background=True)
    tiers.mover = Mover(tiers.mover.streams, tiers.codec, make_executor(True, "test-mover"))   # as when serving
    lengths = {"again": 8, **{rid: 20 for rid in others}}
    prompts = {"again": long[:800], **others}
    for rid, prompt in prompts.items():
        eng.add_request(rid, list(prompt), SamplingParams(max_tokens=lengths[rid], **GREEDY))
    out = {rid: [] for rid in prompts}
    steps = 0
    while any(len(out[rid]) < lengths[rid] for rid in others):
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        assert tiers.reads, "the disk read is not pending"
        steps += 1
        assert steps < 200, "the other requests did not finish while the read was held"
    assert tiers.reads and out["again"] == [], "the restore finished while its read was held"
    for _ in range(4):                # the others' last outputs
        if not eng.step():
            break
    waits, wait_briefly = [], tiers.wait_briefly
    monkeypatch.setattr(tiers, "wait_briefly", lambda timeout: waits.append(timeout) or wait_briefly(timeout))
    assert eng.step() == [] and waits, "with only the held restore left, a step spun instead of waiting on it"
    gate.set()
    for job in list(tiers.reads.values()):
        job.future.result()
    with Ops() as ops:
        tiers.poll()                  # publishes the entries the disk thread filled: no copy here
    assert not tiers.reads and not ops.names, ops.names
    while eng.has_unfinished():
        for job in list(tiers.loads.values()):
            job.ticket.future.result()    # issued by the mover's thread (the test, not the engine, waits)
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        steps += 1
        assert steps < 400
    plain = tiny.engine(max_num_batched_tokens=256, max_num_seqs=6, num_pages=60, enable_prefix_caching=False)
    assert out == run(plain, prompts, lengths)
    assert tiers.stats.hit_tokens["disk"] == 768 and tiers.stats.bytes["disk_to_host"] > 0
    tiers.close()
    assert not tiers.busy
