"""Write a checkpoint folder shard by shard: tensors are buffered until `end_shard()`, which
writes them as one safetensors file; `finish()` names the shards `model-0000i-of-0000n`,
writes the index, config.json and a copy of the source folder's other files (tokenizer,
encoder, generation config), then moves the folder into place. Everything is written in a
temporary sibling folder, so a failed conversion leaves no partial output."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"


def is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") or name == INDEX


def check_output_dir(out_dir: str, src_dir: str) -> None:
    """OUT must be new (or an empty folder) and must not be, or lie inside, the source."""
    out, src = os.path.realpath(out_dir), os.path.realpath(src_dir)
    if out == src or out.startswith(src + os.sep):
        raise ValueError(f"output {out_dir!r} is the source folder or inside it; the source is never modified")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"output {out_dir!r} exists and is not an empty folder")


class ShardWriter:
    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        parent = os.path.dirname(os.path.abspath(out_dir)) or "."
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.partial-", dir=parent)
        self.pending: dict[str, torch.Tensor] = {}
        self.shards: list[list[str]] = []        # keys per written shard
        self.written: set[str] = set()
        self.tensor_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self.pending or key in self.written:
            raise ValueError(f"tensor {key!r} written twice (two source tensors map to it)")
        self.pending[key] = tensor.contiguous()

    def end_shard(self) -> None:
        """Write the buffered tensors as the next shard (nothing when the buffer is empty)."""
        if not self.pending:
            return
        save_file(self.pending, self._shard_path(len(self.shards)), metadata={"format": "pt"})
        self.tensor_bytes += sum(t.numel() * t.element_size() for t in self.pending.values())
        self.shards.append(sorted(self.pending))
        self.written.update(self.pending)
        self.pending = {}

    def finish(self, config: dict, src_dir: str) -> int:
        """Name the shards, write index and config, copy the source's other files, move the
        folder to `out_dir`; returns the bytes written."""
        self.end_shard()
        if not self.shards:
            raise ValueError("no tensors to write")
        n, weight_map = len(self.shards), {}
        for i, keys in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self._shard_path(i), os.path.join(self.tmp, name))
            weight_map.update(dict.fromkeys(keys, name))
        with open(os.path.join(self.tmp, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.tensor_bytes}, "weight_map": weight_map}, f, indent=2)
        _copy_other_files(src_dir, self.tmp)
        with open(os.path.join(self.tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        written = _folder_bytes(self.tmp)
        if os.path.isdir(self.out_dir):
            os.rmdir(self.out_dir)                 # empty (check_output_dir)
        os.replace(self.tmp, self.out_dir)
        return written

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _shard_path(self, i: int) -> str:
        return os.path.join(self.tmp, f".shard-{i:05d}.tmp")


def _copy_other_files(src_dir: str, dst_dir: str) -> None:
    """Everything at the top of the source folder except the weights and config.json."""
    for name in sorted(os.listdir(src_dir)):
        if is_weight_file(name) or name == "config.json" or name.startswith("."):
            continue
        src = os.path.join(src_dir, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dst_dir, name))
        else:
            shutil.copy2(src, os.path.join(dst_dir, name))


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
