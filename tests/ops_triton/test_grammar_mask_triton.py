"""The one-launch grammar mask against the sampler's torch definition (engine/sampler.py)."""
import pytest
import torch

from dsv4.engine.sampler import apply_grammar_mask
from dsv4.ops.backend import forced
from dsv4.ops.triton.grammar_mask import BLOCK_V, masked_copy
from dsv4.ops.triton.grammar_mask import apply_grammar_mask as one_launch
from dsv4.structured.masks import GrammarMask, words


@pytest.mark.parametrize("B, rows, V", [(4, [0, 1, 2, 3], 100), (5, [3, 0], BLOCK_V + 33), (3, [2], 64)])
@pytest.mark.parametrize("with_keep", [False, True])
def test_matches_the_torch_definition(device, B, rows, V, with_keep):
    g = torch.Generator().manual_seed(B * V + with_keep)
    W = words(V) + 1                                   # a wider bitmask than the vocabulary needs
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), W), generator=g, dtype=torch.int64).to(torch.int32)
    keep = torch.randint(-2**31, 2**31 - 1, (W,), generator=g, dtype=torch.int64).to(torch.int32) if with_keep else None
    logits = torch.randn(B, V, generator=g)
    covers_all = rows == list(range(B))
    mask = GrammarMask(torch.tensor(rows), bitmask, covers_all, keep)
    expected = logits.clone()
    with forced("reference"):
        apply_grammar_mask(expected, mask)
    got = logits.to(device)
    one_launch(got, mask.rows.to(device), bitmask.to(device), None if keep is None else keep.to(device), covers_all)
    assert torch.equal(got.cpu(), expected)
    assert (expected == float("-inf")).any() and (expected != float("-inf")).any()    # both kinds of token met


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_keep", [False, True])
def test_masked_copy_is_the_fp32_copy_then_the_mask(device, dtype, with_keep):
    """masked_copy (the sampler's copy and mask in one launch, every row masked) equals the fp32
    copy followed by the torch definition, and leaves its input alone."""
    B, V = 3, BLOCK_V + 45
    g = torch.Generator().manual_seed(V + with_keep)
    W = words(V)
    bitmask = torch.randint(-2**31, 2**31 - 1, (B, W), generator=g, dtype=torch.int64).to(torch.int32)
    keep = torch.randint(-2**31, 2**31 - 1, (W,), generator=g, dtype=torch.int64).to(torch.int32) if with_keep else None
    logits = torch.randn(B, V, generator=g).to(dtype)
    expected = logits.float()
    with forced("reference"):
        apply_grammar_mask(expected, GrammarMask(torch.arange(B), bitmask, True, keep))
    source = logits.to(device)
    got = masked_copy(source, bitmask.to(device), None if keep is None else keep.to(device))
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), expected)
    assert torch.equal(source.cpu(), logits)
