"""The prefix cache's checkpoint copies, recorded on rank 0 for another rank to replay
(docs/architecture.md, "Parallelism"): under tensor parallelism every rank replays rank 0's
copies (engine/workers.py); under data-parallel attention rank r replays those its own
records made (engine/data_parallel.py). A record names a checkpoint by its row of
`storage.checkpoints`, so it replays on any rank's storage of the same plan."""
from __future__ import annotations

import torch


class RecordedCheckpoints:
    """A `storage.checkpoint_format` on rank 0: runs every pack / unpack of the prefix cache
    (cache/manager.py) with `fmt` and records it, the checkpoint buffer as its row of
    `storage.checkpoints`; the ranks that own a copy of that storage replay the records in
    order before their next step. They are in stream order there as on rank 0: after the step
    launched before them, before the next one. (Under data-parallel attention `fmt` copies
    nothing for a storage that lives on another rank.)"""

    def __init__(self, fmt, storage):
        self.fmt, self.storage, self.ops = fmt, storage, []

    def __getattr__(self, name):
        return getattr(self.fmt, name)

    def _row(self, buf: torch.Tensor) -> int:
        ckpts = self.storage.checkpoints
        return (buf.data_ptr() - ckpts.data_ptr()) // (ckpts.stride(0) * ckpts.element_size())

    def pack(self, storage, swa_table, slot, L, out, staged=False):
        self.ops.append(("pack", list(swa_table), slot, L, self._row(out), staged))
        return self.fmt.pack(storage, swa_table, slot, L, out, staged)

    def unpack(self, storage, buf, swa_table, slot, L):
        self.ops.append(("unpack", list(swa_table), slot, L, self._row(buf)))
        return self.fmt.unpack(storage, buf, swa_table, slot, L)

    def take(self) -> list:
        ops, self.ops = self.ops, []
        return ops


def replay_checkpoint_ops(storage, ops: list) -> None:
    fmt = storage.checkpoint_format
    for op in ops:
        if op[0] == "pack":
            _, swa, slot, L, row, staged = op
            fmt.pack(storage, swa, slot, L, storage.checkpoints[row], staged)
        else:
            _, swa, slot, L, row = op
            fmt.unpack(storage, storage.checkpoints[row], swa, slot, L)
