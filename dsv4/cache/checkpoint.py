"""The resume unit: a request's private state at a page boundary (docs/architecture.md, "Cache").

Resuming a request at L (L % 256 == 0) needs the shared history pages before L plus the
private rows a chunk starting at L reads (cache/addressing.py):
  * SWA keys of positions [L - W, L), every layer (its window reaches back W - 1 positions);
  * the CSA compressor's and the CSA indexer's ring rows (kv and gate) of positions
    [L - 4, L): the first group closing after L pools them as its overlap half;
  * nothing of the HCA compressor: its group closed at L (256 % 128 == 0).
The overlap rows are read from the ring by position (`p % csa_ring`) when the chunk ended near
L, or from the staging rows where a chunk that crossed L wrote them (layout.py).
A checkpoint is those rows packed into one flat buffer, sections in the order of
`CheckpointFormat.sections`, each [layers, rows, width] row-major. The buffer is of the cache
dtype; with packed FP8 KV (`layout.kv_fp8`) it is bytes (uint8), the SWA section holds the
packed rows as they are stored and the ring sections (never packed) are viewed as the model
dtype inside it (every section's byte length is a multiple of 4, so the views stay aligned). Rows are indexed by
position, not by ring row or SWA slot, so a checkpoint restores into any request's pages and
slot (and into a layout with another number of speculative slots).

The layout signature names everything the bytes depend on: the model config (every field
ModelConfig compares), the weight and KV dtypes, the layers holding SWA keys and the format
version. A unit with another signature is refused (`CheckpointMismatch`), never loaded.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch

from ..config import CSA_RATIO
from .layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout

FORMAT_VERSION = 1
OVERLAP = CSA_RATIO       # ring rows a CSA group reads before its own: positions [L - 4, L)


class CheckpointMismatch(ValueError):
    """A checkpoint made for another model, dtype or format."""


@dataclass(frozen=True)
class Section:
    kind: str            # the KVStorage kind its rows come from
    layers: int
    rows: int            # positions
    width: int           # elements of `dtype` per row
    dtype: torch.dtype   # the kind's storage dtype (cache/storage.py)

    @property
    def numel(self) -> int:
        return self.layers * self.rows * self.width

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class CheckpointUnit:
    """One checkpoint outside the cache (what the host / disk tiers and disaggregation move)."""
    signature: str
    position: int                # L: the request resumes here
    data: torch.Tensor           # [numel] flat, CheckpointFormat.buffer_dtype


def layout_signature(layout: CacheLayout, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> str:
    """kv_dtype: the KV rows' dtype (None: `dtype`, or packed FP8 with `layout.kv_fp8`)."""
    cfg = layout.cfg
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.compare}
    kv = "packed-fp8" if layout.kv_fp8 else str(kv_dtype or dtype)
    text = json.dumps({"format": FORMAT_VERSION, "model": fields, "dtype": str(dtype), "kv_dtype": kv,
                       "swa_layers": layout.num_swa_layers}, sort_keys=True, default=_jsonable)
    return hashlib.sha256(text.encode()).hexdigest()


def _jsonable(value):
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else str(value)


class CheckpointFormat:
    def __init__(self, layout: CacheLayout, dtype: torch.dtype):
        c = layout.cfg
        self.window = c.sliding_window
        if not 0 < self.window <= PAGE_TOKENS:
            raise ValueError(f"sliding_window {self.window}: checkpoints need 0 < W <= {PAGE_TOKENS}")
        self.buffer_dtype = torch.uint8 if layout.kv_fp8 else dtype
        swa_dtype = torch.uint8 if layout.kv_fp8 else dtype          # (storage.storage_dtype)
        csa, D, Di = len(layout.csa_layers), c.head_dim, c.index_head_dim
        self.sections = (Section("swa", layout.num_swa_layers, self.window, layout.entry_width, swa_dtype),
                         Section("ring_kv", csa, OVERLAP, 2 * D, dtype), Section("ring_gate", csa, OVERLAP, 2 * D, dtype),
                         Section("iring_kv", csa, OVERLAP, 2 * Di, dtype),
                         Section("iring_gate", csa, OVERLAP, 2 * Di, dtype))
        if layout.kv_fp8 and any(s.nbytes % 4 for s in self.sections):
            raise ValueError(f"checkpoint sections of {[s.nbytes for s in self.sections]} bytes: the typed "
                             f"views of a byte buffer need multiples of 4")
        self.numel = sum(s.nbytes for s in self.sections) // self.buffer_dtype.itemsize
        self.signature = layout_signature(layout, dtype)

    def nbytes(self) -> int:
        return self.numel * self.buffer_dtype.itemsize

    # ---- between the cache and a flat buffer ---------------------------------------------
    def pack(self, storage, swa_table: list[int], slot: int, L: int, out: torch.Tensor, staged: bool = False
             ) -> None:
        """Copy the rows a resume at L needs from a request's SWA pages and ring slot into `out`
        (`staged`: its overlap rows from the slot's staging rows)."""
        for section, view in zip(self.sections, self._views(out)):
            view.copy_(self._rows(storage, section, swa_table, slot, L, staged))

    def unpack(self, storage, buf: torch.Tensor, swa_table: list[int], slot: int, L: int) -> None:
        """Write a checkpoint at L into a request's SWA pages and ring slot, at the same positions."""
        for section, view in zip(self.sections, self._views(buf)):
            self._put_rows(storage, section, swa_table, slot, L, view)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        if flat.shape != (self.numel,):
            raise ValueError(f"checkpoint buffer of shape {tuple(flat.shape)}, expected ({self.numel},)")
        out, start = [], 0
        for s in self.sections:
            n = s.nbytes // flat.element_size()
            out.append(flat[start:start + n].view(s.dtype).view(s.layers, s.rows, s.width))
            start += n
        return out

    def _positions(self, section: Section, L: int) -> torch.Tensor:
        if L % PAGE_TOKENS or L < PAGE_TOKENS:
            raise ValueError(f"checkpoint position {L} is not a positive multiple of {PAGE_TOKENS}")
        return torch.arange(L - section.rows, L)

    def _swa_index(self, storage, swa_table: list[int], positions: torch.Tensor):
        table = torch.tensor(swa_table, dtype=torch.long)
        pages = table[positions // SWA_PAGE_TOKENS]
        if bool((pages < 0).any()):
            raise RuntimeError(f"SWA page of positions [{int(positions[0])}, {int(positions[-1]) + 1}) not held")
        device = storage.kinds["swa"].device
        return _upload(pages, device), _upload(positions % SWA_PAGE_TOKENS, device)

    def _rows(self, storage, section: Section, swa_table, slot, L, staged: bool) -> torch.Tensor:
        """[layers, rows, width] of `section` at positions [L - rows, L)."""
        positions, blocks = self._positions(section, L), storage.kinds[section.kind]
        if section.kind == "swa":
            pages, rows = self._swa_index(storage, swa_table, positions)
            return blocks[pages, :, rows].transpose(0, 1)         # [rows, layers, D] -> [layers, rows, D]
        cap = storage.layout.csa_ring
        rows = torch.arange(cap, cap + OVERLAP) if staged else positions % cap
        return blocks[slot][:, _upload(rows, blocks.device)]

    def _put_rows(self, storage, section: Section, swa_table, slot, L, data: torch.Tensor) -> None:
        positions, blocks = self._positions(section, L), storage.kinds[section.kind]
        if section.kind == "swa":
            pages, rows = self._swa_index(storage, swa_table, positions)
            blocks[pages, :, rows] = data.transpose(0, 1)
        else:
            blocks[slot][:, _upload(positions % storage.layout.csa_ring, blocks.device)] = data

    # ---- a unit outside the cache --------------------------------------------------------
    def unit(self, buf: torch.Tensor, L: int) -> CheckpointUnit:
        return CheckpointUnit(self.signature, L, buf.detach().to("cpu", copy=True))

    def check(self, unit: CheckpointUnit) -> torch.Tensor:
        """The unit's data, once its signature and size match this format's."""
        if unit.signature != self.signature:
            raise CheckpointMismatch(f"checkpoint of layout {unit.signature[:16]}..., this cache's layout is "
                                     f"{self.signature[:16]}... (another model config, dtype or format version)")
        if unit.data.dtype != self.buffer_dtype or unit.data.shape != (self.numel,):
            raise CheckpointMismatch(f"checkpoint data {unit.data.dtype} x {tuple(unit.data.shape)}, expected "
                                     f"{self.buffer_dtype} x ({self.numel},)")
        return unit.data


def to_bytes(unit: CheckpointUnit) -> bytes:
    """A header line (JSON: signature, position, dtype, numel), then the raw data."""
    data = unit.data.contiguous().cpu()
    header = json.dumps({"signature": unit.signature, "position": unit.position, "dtype": str(data.dtype),
                         "numel": data.numel()}).encode()
    return header + b"\n" + data.view(torch.uint8).numpy().tobytes()


def from_bytes(blob: bytes) -> CheckpointUnit:
    """The unit `to_bytes` wrote; CheckpointMismatch when the bytes are not one."""
    header, sep, raw = blob.partition(b"\n")
    try:
        meta = json.loads(header)
        dtype = getattr(torch, meta["dtype"].removeprefix("torch."))
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
    except (ValueError, KeyError, AttributeError, RuntimeError, TypeError) as e:
        raise CheckpointMismatch(f"not a checkpoint: {e}") from None
    if not sep or data.numel() != meta["numel"]:
        raise CheckpointMismatch(f"checkpoint data truncated: {data.numel()} of {meta.get('numel')} elements")
    return CheckpointUnit(meta["signature"], int(meta["position"]), data)


def _upload(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on the cache's device without a host wait: a plain `.to("cuda")` of
    pageable memory synchronizes the stream (the step in flight); a pinned copy is only queued
    (commit and admission run while the previous step runs, docs/architecture.md "Engine")."""
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)
