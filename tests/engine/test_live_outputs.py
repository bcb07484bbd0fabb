"""`LLMEngine.live_outputs` (the engine core's mode): outputs hold the request's own token and
logprob lists instead of a copy per step. The tokens, logprobs and per-step new tokens a
consumer reads within each step are those of the snapshot mode, and a snapshot output keeps
its contents after later steps."""
from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams


def _run(live: bool) -> tuple[list, list]:
    eng = LLMEngine("random:tiny", EngineConfig(device="cpu", max_num_batched_tokens=32, max_num_seqs=4))
    eng.live_outputs = live
    for i, n in enumerate((5, 40, 17)):
        eng.add_request(f"r{i}", [(3 * j + i) % 500 + 2 for j in range(n)],
                        SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True, logprobs=1))
    seen, kept = [], []
    while eng.has_unfinished():
        for out in eng.step():
            seen.append((out.request_id, out.new_token_ids, list(out.token_ids),
                         [sorted(d) for d in out.logprobs], out.finished))
            kept.append((out, len(out.token_ids)))
    return seen, kept


def test_live_outputs_read_like_snapshots_within_the_step():
    live, live_kept = _run(True)
    snap, snap_kept = _run(False)
    assert live == snap and any(finished for *_, finished in snap)
    assert all(len(out.token_ids) == n for out, n in snap_kept)          # snapshots do not move
    assert any(len(out.token_ids) != n for out, n in live_kept)          # live lists are the requests' own
