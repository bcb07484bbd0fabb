"""The two-pass attention kernels (dsv4/ops/triton/attention_two_pass.py: scores of the last
source into a probability buffer by slot tiles, then the values pass with the other source
walked) against the torch reference (dsv4.ops.attention), the definition: tokens of several
requests (groups by request and range start), windows, prefixes, empty ranges, -1 pages; a
prefill chunk deep in a prompt (entries closing inside the chunk); several passes over the
tokens; one source; large scores and sinks."""
import pathlib
import sys

import pytest
import torch

from dsv4.ops.triton import attention_two_pass as two_pass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from shared_inputs import D, check_kernel, chunk_inputs, first_tokens, random_inputs  # noqa: E402


def check(q, sources, sinks, **knobs):
    return check_kernel(two_pass.two_pass_attention, q, sources, sinks, **knobs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("score_tiles, value_tiles", [((2, 8, 16, 16, 4, 1), (2, 8, 16, 2, 4, 1)),
                                                      ((4, 4, 32, 32, 4, 1), (1, 16, 16, 1, 4, 1)),
                                                      ((1, 16, 32, 64, 4, 1), (4, 4, 32, 1, 4, 1))])
def test_mixed_requests(device, dtype, score_tiles, value_tiles):
    """Tokens of 3 requests in any order with any ranges; 13 tokens in passes of 8 (a partial
    tile in each); the two passes' row tiles differ, pass 2 steps by half a tile of pass 1; rows
    with no valid key get 0."""
    q, sources, sinks = random_inputs(device, 13, 8, dtype)
    check(q, sources, sinks, score_tiles=score_tiles, value_tiles=value_tiles, tokens_per_pass=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [0, 150])
def test_prefill_chunk(device, dtype, start):
    """A chunk at position `start`: one group a tile on the history (pages of 2, then one-item
    pages as the engine hands it over), entries closing inside the chunk, a group a token on the
    window; 6 heads (a partial head block); passes of 9 tokens."""
    q, sources, sinks = chunk_inputs(device, 14, 6, dtype, start)
    check(q, sources, sinks, score_tiles=(2, 8, 16, 32, 4, 1), value_tiles=(2, 8, 16, 2, 4, 1))
    one_item = [sources[0], (sources[1][0], sources[1][1].one_item_pages())]
    check(q, one_item, sinks, score_tiles=(4, 4, 32, 16, 4, 1), value_tiles=(1, 16, 16, 1, 4, 1), tokens_per_pass=9)


def test_one_source_and_empty(device):
    """The history alone; zero tokens; zero-width ranges (every row on the sink alone: 0)."""
    q, sources, sinks = random_inputs(device, 9, 4, torch.float32)
    check(q, sources[1:], sinks)
    assert two_pass.two_pass_attention(q[:0], first_tokens(sources, 0), sinks, 0.125).shape == (0, 4, D)
    q, sources, sinks = random_inputs(device, 9, 4, torch.float32, widths=(0, 0))
    assert check(q, sources, sinks).abs().max() == 0


def test_large_logits_and_sinks(device):
    """Large scores and sinks: a tile's P is relative to its own max, the merge never overflows."""
    q, sources, sinks = chunk_inputs(device, 8, 4, torch.float32, 50)
    sinks = torch.tensor([40.0, -40.0, 0.0, 5.0], device=q.device)
    check(30 * q, sources, sinks)
