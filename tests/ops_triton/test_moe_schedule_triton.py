"""The grouped GEMMs' tile schedule in one Triton launch (dsv4/ops/triton/moe_schedule.py) is
bit-equal to its torch definition `schedule_reference`: few and many pairs (several blocks of
the one-hot tile, several slot blocks), 8 to 384 experts (not powers of two too), empty
experts, every pair on one expert, M-tiles of 1 to 128 rows; and large schedules stay on torch."""
import pytest
import torch

from dsv4.ops.triton import moe_schedule


def _ids(P, E, seed, device, same=False):
    g = torch.Generator().manual_seed(seed)
    if same:
        return torch.full((P,), E - 1 - seed % E, dtype=torch.long, device=device)
    return torch.randint(0, E, (P,), generator=g).to(device)


@pytest.mark.parametrize("P,E,block_m", [(1, 8, 16), (7, 8, 1), (600, 8, 4), (1500, 8, 64), (300, 37, 16),
                                         (700, 256, 128), (900, 384, 16), (2100, 16, 16)])
@pytest.mark.parametrize("same", [False, True])
def test_kernel_equals_the_definition(P, E, block_m, same, monkeypatch, device):
    monkeypatch.setattr(moe_schedule, "KERNEL_MAX_WORK", 1 << 30)    # the kernel at every size here
    ids = _ids(P, E, P + E, device, same)
    order, sched = moe_schedule.schedule(ids, E, block_m)
    want_order, want_sched = moe_schedule.schedule_reference(ids, E, block_m)
    assert order.dtype == sched.dtype == torch.int32
    assert torch.equal(order, want_order)
    assert torch.equal(sched, want_sched)


def test_skewed_experts_over_many_blocks(monkeypatch, device):
    """Most pairs on two experts, some on none: per-expert row counters carried across blocks."""
    monkeypatch.setattr(moe_schedule, "KERNEL_MAX_WORK", 1 << 30)
    E = 40
    ids = torch.cat([torch.full((700,), 3), torch.arange(0, E, 2).repeat(20), torch.full((333,), 39)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(1))].to(device)
    for block_m in (16, 64):
        got = moe_schedule.schedule(ids, E, block_m)
        want = moe_schedule.schedule_reference(ids, E, block_m)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_large_schedules_stay_on_torch(monkeypatch):
    """Past KERNEL_MAX_WORK (P * EP) the torch ops run: no launch."""
    monkeypatch.setattr(moe_schedule, "KERNEL_MAX_WORK", 64 * 16)
    monkeypatch.setattr(moe_schedule, "_schedule_kernel", None)       # a launch would fail
    assert moe_schedule.kernel_fits(64, 8) and not moe_schedule.kernel_fits(65, 8)
    ids = _ids(65, 8, 0, "cpu")
    got = moe_schedule.schedule(ids, 8, 16)
    want = moe_schedule.schedule_reference(ids, 8, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
