"""Process groups and the collectives the sharded model calls (docs/architecture.md,
"Parallelism"). NCCL on CUDA devices, gloo on the CPU; NVLink multicast stays off in every
process (`NO_MULTICAST_ENV`), so no collective takes the NVLS / symmetric-memory paths."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# set in every process dsv4 starts for a parallel run (and in the parent before it spawns)
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_no_multicast_env() -> None:
    os.environ.update(NO_MULTICAST_ENV)


def free_port() -> int:
    """A free TCP port on the loopback interface (the rendezvous of one parallel run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torch renamed all_gather_into_tensor (deprecated from 2.13 on)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Comm:
    """One rank's view of its group: `group` carries the model's collectives (NCCL on CUDA,
    gloo on the CPU), `control` (always gloo, CPU tensors and pickled objects) carries the
    step descriptions and never times out (an idle engine sends no step for as long as it
    idles). rank 0 runs the scheduler."""
    rank: int
    size: int
    device: torch.device
    group: object = None
    control: object = None

    @classmethod
    def init(cls, rank: int, size: int, port: int, device: str, timeout_s: float = 600.0) -> "Comm":
        set_no_multicast_env()
        from datetime import timedelta
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", rank if dev.index is None else dev.index + rank)
            torch.cuda.set_device(dev)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        # the control group waits for rank 0's next step however long the engine idles
        control = dist.new_group(backend="gloo", timeout=timedelta(days=365))
        return cls(rank, size, dev, dist.group.WORLD, control)

    # ---- model collectives (tensors on self.device) --------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (returns x)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank r's columns at [r*n, (r+1)*n)."""
        parts = self.all_gather_rows(x.reshape(-1, x.shape[-1])).view(self.size, -1, x.shape[-1])   # [size, rows, n]
        return parts.transpose(0, 1).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[M, ...] on every rank (same M) -> [size * M, ...], rank r's rows at [r*M, (r+1)*M)."""
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[size * M, ...] on every rank -> [M, ...]: the sum over ranks of rows [r*M, (r+1)*M)."""
        out = torch.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=self.group)
        return out

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of x, send[r] of them to rank r in rank order -> the rows received, recv[r] from r."""
        out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(x, src, group=self.group)
        return x

    def all_gather_ints(self, value: int) -> list[int]:
        """One integer per rank, through the control group (host side)."""
        t = torch.tensor([value], dtype=torch.long)
        out = [torch.zeros(1, dtype=torch.long) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.control)
        return [int(v) for v in out]

    # ---- step descriptions (host objects) -----------------------------------------------
    def broadcast_object(self, obj=None, src: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src, group=self.control)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
