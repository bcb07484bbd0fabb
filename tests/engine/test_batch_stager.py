"""The pinned stager packs a step's index tensors into one buffer and unpacks them unchanged."""
import torch

from dsv4.cache.layout import CacheLayout
from dsv4.engine.batch import PinnedStager, SeqChunk, _to_staged, build_forward_batch
from dsv4.model.forward_batch import CompressPlan, ForwardBatch
from dsv4.model.random_init import preset_config


def _fields(fb):
    out = {f: getattr(fb, f) for f in ForwardBatch.__dataclass_fields__ if f not in ("csa", "hca")}
    for k in ("csa", "hca"):
        out.update({f"{k}.{f}": getattr(getattr(fb, k), f) for f in CompressPlan.__dataclass_fields__})
    return out


def test_staged_batch_equals_the_direct_one():
    layout = CacheLayout(preset_config("tiny"))
    chunks = [SeqChunk(0, 0, list(range(300)), [0, 1], [0, 1, 2]),
              SeqChunk(1, 130, list(range(7)), [2], [4, 3])]
    fb = build_forward_batch(chunks, layout, 2, "cpu")
    stager = PinnedStager(pin=False)
    for _ in range(2):  # the buffer is reused on the second step
        staged = _fields(_to_staged(fb, "cpu", stager))
        for name, value in _fields(fb).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(staged[name], value), name
            else:
                assert staged[name] == value, name
