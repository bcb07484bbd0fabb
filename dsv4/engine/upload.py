"""Host -> device transfers of a step's small tensors without stalling the host.

A copy from pageable memory makes the host wait for the GPU stream to drain, which would
serialise the next step's host work behind the running step. Everything a step sends goes
through `HostToDevice`: the tensors (any dtypes) are packed, 16-byte aligned, into one pinned
byte buffer and cross in one asynchronous copy. Buffers rotate, and a buffer is refilled only
after the event recorded behind its last copy has passed, so packing step k+1 never
overwrites bytes that step k's copy has yet to read.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

ALIGN = 16


def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // ALIGN) * ALIGN
    return offsets, total


def packed_bytes(sizes: list[int]) -> int:
    """The size of the buffer `_layout` lays tensors of these byte sizes out in."""
    return sum(-(-n // ALIGN) * ALIGN for n in sizes)


_NUMPY_LACKS = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)      # dtypes numpy has not


class HostToDevice:
    def __init__(self, device, num_buffers: int = 8, pack: bool = True):
        """On a CPU device the same packing runs (unpinned, no events), so CPU tests take the
        GPU's path; pack=False moves each tensor on its own."""
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.packs = pack
        self.buffers: list[torch.Tensor | None] = [None] * num_buffers
        self.events: list[torch.cuda.Event | None] = [None] * num_buffers
        self.turn = 0

    def upload(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """CPU tensors -> the same tensors on the device (views of one fresh device buffer)."""
        if not self.packs:
            return [t.to(self.device) for t in tensors]
        host, offsets = self._pack(tensors)
        flat = host.to(self.device, non_blocking=True, copy=True)   # (a CPU device: the buffer rotates)
        self._record()
        return views(flat, tensors, offsets)

    def upload_into(self, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Copy `tensors` into `flat`, a device buffer laid out by `allocate` for these shapes."""
        if not self.packs:
            for dst, t in zip(views(flat, tensors, _layout(tensors)[0]), tensors):
                dst.copy_(t)
            return
        host, _ = self._pack(tensors)
        flat[:host.numel()].copy_(host, non_blocking=True)
        self._record()

    def allocate(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A device buffer for tensors of these shapes and dtypes, and its views (filled)."""
        offsets, total = _layout(tensors)
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        self.upload_into(flat, tensors)
        return flat, views(flat, tensors, offsets)

    def _pack(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        offsets, total = _layout(tensors)
        i = self.turn = (self.turn + 1) % len(self.buffers)
        if self.events[i] is not None:
            self.events[i].synchronize()        # its copy was issued steps ago: long done
        have = self.buffers[i].numel() if self.buffers[i] is not None else 0
        if have < total:
            self.buffers[i] = torch.empty(max(total, 2 * have, 4096),
                                          dtype=torch.uint8, pin_memory=self.on_cuda)
        host = self.buffers[i][:total]
        raw = host.numpy()
        for t, off in zip(tensors, offsets):
            if t.dtype in _NUMPY_LACKS:         # (bfloat16, FP8): the bytes through torch
                if t.numel():
                    host[off:off + t.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
            else:        # numpy: a copy costs ~1 us against ~10 us for torch's slice-view-copy
                a = t.numpy().ravel()
                raw[off:off + a.nbytes].view(a.dtype)[:] = a
        return host, offsets

    def _record(self) -> None:
        if not self.on_cuda:
            return
        event = torch.cuda.Event()
        event.record()
        self.events[self.turn] = event


def views(flat: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    """Contiguous views of `flat` (uint8, offset and length multiples of ALIGN) shaped as
    `tensors` at byte `offsets` (each a multiple of its tensor's element size): one as_strided
    each on a view of flat per dtype (a slice, a dtype view and a shape view cost ~3x the time)."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for t, off in zip(tensors, offsets):
        whole = typed.get(t.dtype)
        if whole is None:
            whole = typed[t.dtype] = flat.view(t.dtype)
        strides = t.stride() if t.is_contiguous() else _contiguous_strides(t.shape)
        out.append(whole.as_strided(t.shape, strides, whole.storage_offset() + off // t.element_size()))
    return out


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def tensor_leaves(obj) -> list[tuple[tuple, torch.Tensor]]:
    """(path, tensor) for every tensor in a tree of dataclasses and tuples."""
    if isinstance(obj, torch.Tensor):
        return [((), obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [((f.name, *p), t) for f in dataclasses.fields(obj)
                for p, t in tensor_leaves(getattr(obj, f.name))]
    if isinstance(obj, tuple) and not _plain(obj):
        return [((i, *p), t) for i, x in enumerate(obj) for p, t in tensor_leaves(x)]
    return []


def leaf_tensors(obj) -> list[torch.Tensor]:
    """The tensors of `tensor_leaves(obj)`, in its order, without building their paths (what a
    step's upload needs)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in leaf_tensors(getattr(obj, f.name))]
    if isinstance(obj, tuple) and not _plain(obj):
        return [t for x in obj for t in leaf_tensors(x)]
    return []


def _plain(values: tuple) -> bool:
    """A tuple of numbers only (ForwardBatch.seq_lens: one per sequence), with no tensor to
    look for: checked in C, not one call per element."""
    return set(map(type, values)) <= {int, float}


def replace_leaves(obj, new: dict[tuple, torch.Tensor], path: tuple = ()):
    """The tree with the tensor at each path in `new` replaced (other leaves kept)."""
    if isinstance(obj, torch.Tensor):
        return new.get(path, obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: replace_leaves(getattr(obj, f.name), new, (*path, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple) and not _plain(obj):
        return tuple(replace_leaves(x, new, (*path, i)) for i, x in enumerate(obj))
    return obj


def upload_tree(obj, h2d: HostToDevice):
    """A dataclass tree with every CPU tensor moved to the device in one transfer."""
    leaves = [(p, t) for p, t in tensor_leaves(obj) if t.device.type == "cpu"]
    moved = h2d.upload([t for _, t in leaves])
    return replace_leaves(obj, {p: m for (p, _), m in zip(leaves, moved)})
