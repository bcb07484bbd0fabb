"""The disk tier's file format: one file per prefix group (docs/architecture.md, "Host and disk tiers").

A group is the history pages a..b-1 of one prefix and, optionally, the checkpoint tail at
L = 256 b. A file is one header line (JSON: magic, layout signature, parent key = key_{a-1} or
"" for a = 0, the pages' keys, whether a tail follows, row sizes, dtype, payload bytes and the
payload's sha256), then the payload: the page rows, then the tail row, raw. Files are named by
their last page's key and whether a tail follows. Reading checks everything it can before anything is used: a wrong
signature (`SignatureMismatch`), a short file or a checksum that does not match (`Corrupt`) —
so nothing wrong is ever loaded.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

MAGIC = "dsv4-kv-group"
VERSION = 1
SUFFIX = ".kv"
MAX_HEADER = 1 << 20


class Corrupt(ValueError):
    """A truncated, damaged or foreign file."""


class SignatureMismatch(ValueError):
    """A group written under another checkpoint layout signature."""


@dataclass(frozen=True)
class Header:
    signature: str
    parent: str                  # hex key of the page before the group ("" at the root)
    keys: tuple[str, ...]        # hex keys of its pages, in order
    tail: bool                   # a checkpoint tail at the end of its last page follows
    page_numel: int
    tail_numel: int
    dtype: str
    payload: int                 # bytes after the header line
    sha256: str
    header_bytes: int = 0        # length of the header line, newline included

    @property
    def name(self) -> str:
        return group_name(self.keys[-1], self.tail)


def group_name(last_key: str, tail: bool) -> str:
    """A group's file name: its last page's key, then whether it ends with a tail."""
    return f"{last_key}.{'t' if tail else 'p'}{SUFFIX}"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise Corrupt(f"unknown dtype {name!r}")
    return dtype


def encode_parts(signature: str, parent: str, keys: list[str], pages: torch.Tensor,
                 tail: torch.Tensor | None) -> list:
    """One group file as buffers to write in order: the header line, then the payload as views of
    `pages` [n, page_numel] (CPU) and `tail` [tail_numel] (or None), not copies. (The disk thread
    builds files: a copy of the payload into a bytes object would hold the interpreter lock for
    its whole length, stalling the step's thread; hashing and writing buffers release it.)"""
    payload = [_raw(pages)] + ([_raw(tail)] if tail is not None else [])
    digest = hashlib.sha256()
    for part in payload:
        digest.update(part)
    head = {"magic": MAGIC, "version": VERSION, "signature": signature, "parent": parent, "keys": keys,
            "tail": tail is not None, "page_numel": pages.shape[1], "tail_numel": 0 if tail is None else tail.numel(),
            "dtype": str(pages.dtype), "payload": sum(p.nbytes for p in payload), "sha256": digest.hexdigest()}
    return [json.dumps(head).encode() + b"\n", *payload]


def encode(signature: str, parent: str, keys: list[str], pages: torch.Tensor, tail: torch.Tensor | None) -> bytes:
    """One group file's bytes (`encode_parts` joined)."""
    return b"".join(encode_parts(signature, parent, keys, pages, tail))


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def parse_header(line: bytes) -> Header:
    """The header of a file whose first line is `line` (newline included); Corrupt if it is not one."""
    try:
        d = json.loads(line)
        if d.get("magic") != MAGIC or d.get("version") != VERSION:
            raise Corrupt(f"not a dsv4 KV group (magic {d.get('magic')!r}, version {d.get('version')!r})")
        head = Header(str(d["signature"]), str(d["parent"]), tuple(str(k) for k in d["keys"]), bool(d["tail"]),
                      int(d["page_numel"]), int(d["tail_numel"]), str(d["dtype"]), int(d["payload"]),
                      str(d["sha256"]), len(line))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise Corrupt(f"unreadable header: {e}") from None
    if not head.keys:
        raise Corrupt("a group without pages")
    elem = torch.empty((), dtype=_dtype(head.dtype)).element_size()
    if head.payload != elem * (len(head.keys) * head.page_numel + head.tail_numel * head.tail):
        raise Corrupt(f"payload of {head.payload} bytes does not match its rows")
    return head


def read_header(path: str) -> tuple[Header, int]:
    """A file's header and its size on disk."""
    with open(path, "rb") as f:
        line = f.readline(MAX_HEADER)
        size = f.seek(0, 2)
    if not line.endswith(b"\n"):
        raise Corrupt("no header line")
    return parse_header(line), size


def check(head: Header, size: int, signature: str) -> None:
    """Raise SignatureMismatch or Corrupt (truncated / padded) for a file that must not be used."""
    if head.signature != signature:
        raise SignatureMismatch(f"layout signature {head.signature[:16]}..., this cache's is {signature[:16]}...")
    if size != head.header_bytes + head.payload:
        raise Corrupt(f"{size} bytes on disk, the header says {head.header_bytes + head.payload}")


def read_group(path: str, signature: str) -> tuple[Header, torch.Tensor, torch.Tensor | None]:
    """A whole group, checked (signature, size, sha256): (header, pages [n, page_numel], tail)."""
    head, size = read_header(path)
    check(head, size, signature)
    dtype = _dtype(head.dtype)
    pages = torch.empty(len(head.keys), head.page_numel, dtype=dtype)
    tail = torch.empty(head.tail_numel, dtype=dtype) if head.tail else None
    read_group_into(path, head, list(pages), tail)
    return head, pages, tail


def read_group_into(path: str, expect: Header, page_rows: list, tail_row) -> int:
    """(disk thread) Read the group file `path`, whose header the index holds as `expect`, straight
    into rows: page i into `page_rows[i]` and the tail into `tail_row` (CPU tensors of the
    file's row sizes and dtype; None: read into a scratch row and dropped, e.g. a page the host
    holds already). Everything is checked (header as indexed, size, sha256); on Corrupt the rows
    hold garbage and the caller must not publish them. Bytes read into rows. No step of this
    holds the interpreter lock for long: reads and hashing release it, and nothing is copied."""
    with open(path, "rb") as f:
        line = f.readline(MAX_HEADER)
        size = f.seek(0, 2)
        if not line.endswith(b"\n"):
            raise Corrupt("no header line")
        head = parse_header(line)
        check(head, size, expect.signature)
        if head != expect:
            raise Corrupt("its header changed since it was indexed")
        if len(page_rows) != len(head.keys):
            raise ValueError(f"{len(page_rows)} rows for a group of {len(head.keys)} pages")
        f.seek(head.header_bytes)
        digest, moved, scratch = hashlib.sha256(), 0, {}
        rows = [(r, head.page_numel) for r in page_rows] + ([(tail_row, head.tail_numel)] if head.tail else [])
        for row, numel in rows:
            dst = row if row is not None else scratch.setdefault(numel, torch.empty(numel, dtype=_dtype(head.dtype)))
            if dst.numel() != numel or str(dst.dtype) != head.dtype or not dst.is_contiguous():
                raise Corrupt(f"rows of {numel} {head.dtype}, the tier's are {dst.numel()} {dst.dtype}")
            view = memoryview(dst.view(torch.uint8).numpy())
            if f.readinto(view) != len(view):
                raise Corrupt("truncated payload")
            digest.update(view)
            moved += len(view) if row is not None else 0
    if digest.hexdigest() != head.sha256:
        raise Corrupt("checksum mismatch")
    return moved

