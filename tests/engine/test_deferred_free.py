"""The prompts of ended requests are freed a slice at a time between steps (engine/deferred_free.py):
never a list someone else still holds, and the engine core's tokens are those of a plain run."""
from __future__ import annotations

from dsv4.engine.core import EngineCore
from dsv4.engine.deferred_free import DeferredFree
from dsv4.engine.ipc import AddRequest
from dsv4.sampling_params import SamplingParams


def test_frees_only_lists_nothing_else_holds_a_slice_a_call():
    free = DeferredFree(min_tokens=4, per_step=3)
    shared = list(range(1000, 1010))
    free.hold(shared)
    free.hold(list(range(2000, 2007)))      # the engine core's case: the holder is the last owner
    free.hold([1, 2, 3])                    # shorter than min_tokens: left alone
    assert len(free) == 2
    assert [free.release() for _ in range(4)] == [3, 3, 1, 0]
    assert len(free) == 1 and shared == list(range(1000, 1010))     # never changed under its owner
    del shared
    assert free.release() == 3 and len(free) == 1
    assert free.release_all() == 7 and len(free) == 0


def test_engine_core_frees_an_ended_prompt_between_steps_with_the_same_tokens(tiny, h, one_thread):
    vocab, config = tiny.cfg.vocab_size, dict(max_num_batched_tokens=64, max_num_seqs=4, num_pages=8)
    prompts = {"long": h.random_ids(vocab, 40, seed=1), "short": h.random_ids(vocab, 6, seed=2)}
    params = {rid: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for rid, n in (("long", 2), ("short", 12))}
    plain = h.drive(tiny.engine(**config), [h.Req(rid, p, params[rid]) for rid, p in prompts.items()])

    core = EngineCore(tiny.engine(**config))
    free = core.engine.deferred_free = DeferredFree(min_tokens=16, per_step=8)
    freed, release = [], free.release
    free.release = lambda budget=None: freed.append(release(budget)) or freed[-1]
    for rid, p in prompts.items():
        core.handle(AddRequest(rid, list(p), params[rid]))
    tokens = {rid: [] for rid in prompts}
    while core.has_work:
        for out in core.step():
            tokens[out.request_id] += out.token_ids
    assert tokens == {rid: out.token_ids for rid, out in plain.items()}
    assert sum(freed) == 40 and max(freed) == 8 and len(free) == 0    # the long prompt, 8 ints a step
    assert core.idle() == []
