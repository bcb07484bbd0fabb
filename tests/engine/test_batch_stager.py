"""Host -> device packing: a step's tensors of mixed dtypes cross in one buffer and arrive
unchanged; a buffer is reused after its turn comes round; a dataclass tree keeps its shape."""
import torch

from dsv4.cache.layout import CacheLayout
from dsv4.cache.addressing import SeqChunk, build_step
from dsv4.engine.upload import HostToDevice, leaf_tensors, tensor_leaves, upload_tree
from dsv4.model.random_init import preset_config


def _chunks():
    return [SeqChunk(0, 0, list(range(300)), [0, 1], [0, 1, 2]),
            SeqChunk(1, 130, list(range(7)), [2], [4, 3])]


def test_packed_batch_equals_the_direct_one():
    layout = CacheLayout(preset_config("tiny"))
    direct = build_step(_chunks(), layout, 2)
    h2d = HostToDevice("cpu", num_buffers=2, pack=True)
    for _ in range(3):  # buffers come round again from the third step
        packed = upload_tree(build_step(_chunks(), layout, 2), h2d)
        a, b = tensor_leaves(direct), tensor_leaves(packed)
        assert [p for p, _ in a] == [p for p, _ in b]
        for (path, x), (_, y) in zip(a, b):
            assert x.dtype == y.dtype and torch.equal(x, y), path
        assert packed.seq_lens == direct.seq_lens and packed.csa.ring_rows == direct.csa.ring_rows
    # the paths-free walk a step's upload uses: the same tensors in the same order
    assert [id(t) for t in leaf_tensors(direct)] == [id(t) for _, t in tensor_leaves(direct)]


def test_mixed_dtypes_and_empty_tensors_round_trip():
    h2d = HostToDevice("cpu", num_buffers=1, pack=True)
    tensors = [torch.tensor([True, False, True]), torch.arange(5, dtype=torch.long),
               torch.empty(0, 3, dtype=torch.long), torch.tensor([0.5, -2.0]), torch.ones(2, 3, dtype=torch.bfloat16),
               torch.arange(6, dtype=torch.int32).view(2, 3).t()]      # not contiguous: packed in order
    tree = (tensors[0], (tensors[1], tensors[2]), tensors[3], tensors[4], tensors[5])
    moved = upload_tree(tree, h2d)
    assert isinstance(moved[1], tuple)
    assert [id(t) for t in leaf_tensors(tree)] == [id(t) for t in tensors]
    for (_, x), (_, y) in zip(tensor_leaves(tree), tensor_leaves(moved)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    flat, views = h2d.allocate(tensors)
    tensors[1] += 10
    h2d.upload_into(flat, tensors)
    assert torch.equal(views[1], torch.arange(10, 15))


def test_host_copy_packs_mixed_dtypes_into_one_buffer():
    """HostCopy's packed read-back (the device path, run on the CPU): every tensor back whole,
    whatever its dtype, shape or emptiness, from one buffer."""
    from dsv4.engine.inflight import HostCopy
    tensors = [torch.tensor([5, 7, 9]), torch.tensor([0.5, -1.25, 3.0]), torch.empty(3, 0, dtype=torch.long),
               torch.empty(3, 0), torch.tensor([True, False, True]), torch.ones(3, 2, dtype=torch.bfloat16),
               torch.arange(6, dtype=torch.int32).view(2, 3).t()]
    copy = HostCopy(tensors, pack=True)
    assert len({t.untyped_storage().data_ptr() for t in copy.host}) == 1     # one buffer
    for x, y in zip(tensors, copy.host):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    assert copy.get()[0] == [5, 7, 9] and copy.get()[2] == [(), (), ()]
