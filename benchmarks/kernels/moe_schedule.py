"""The grouped GEMMs' tile schedule (dsv4/ops/triton/moe_schedule.py): the one-program Triton
kernel against its torch definition `schedule_reference`, at the demo model's and V4-Flash's
expert counts, every size through the kernel (whatever KERNEL_MAX_WORK says) to show where
the kernel's serial work overtakes the torch ops' launches.

    python -m benchmarks.kernels.moe_schedule        # needs CUDA; seconds

Checks first (exit 1 unless bit-equal); then the device time (CUDA events, median) and the host
time of one call (launches only, no sync), for both.
"""
import sys
import time

import torch

from dsv4.bench.timing import median_ms
from dsv4.ops.triton import moe_schedule

# (name, E, k, tokens, BLOCK_M of the up-gate tiles at that size: moe_grouped.default_tiles)
CASES = [("demo", 8, 2, T, 64 if T * 2 < 32 * 8 else 128) for T in (1, 64, 512, 2048, 8192)] + \
        [("flash", 256, 6, T, 64) for T in (1, 16, 64, 512, 2048)]


def host_us(fn, reps: int = 200) -> float:
    """Host µs per call of `fn` (the launches; the device catches up after)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / reps * 1e6


def main() -> int:
    limit, moe_schedule.KERNEL_MAX_WORK = moe_schedule.KERNEL_MAX_WORK, 1 << 40   # the kernel at every size here
    gen = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    print(f"{'case':<6}{'E':>5}{'T':>6}{'P*EP':>10}{'fits':>6}{'torch ms':>10}{'kernel ms':>11}"
          f"{'torch host us':>15}{'kernel host us':>16}")
    for name, E, k, T, bm in CASES:
        ids = torch.randint(0, E, (T * k,), generator=gen, device="cuda")
        got, want = moe_schedule.schedule(ids, E, bm), moe_schedule.schedule_reference(ids, E, bm)
        ok &= all(torch.equal(a, b) for a, b in zip(got, want))
        ref = lambda: moe_schedule.schedule_reference(ids, E, bm)     # noqa: E731
        ker = lambda: moe_schedule.schedule(ids, E, bm)               # noqa: E731
        work = T * k * max(16, 1 << (E - 1).bit_length())             # P * EP (moe_schedule.kernel_fits)
        print(f"{name:<6}{E:>5}{T:>6}{work:>10}{'yes' if work <= limit else 'no':>6}{median_ms(ref):>10.3f}"
              f"{median_ms(ker):>11.3f}{host_us(ref):>15.1f}{host_us(ker):>16.1f}")
    print("OK: bit-equal" if ok else "MISMATCH against schedule_reference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
