"""The sizes of the packed FP8 KV rows (the layout: dsv4/ops/kv_fp8.py), shared by the torch
definition and the Triton writers (dsv4/ops/triton/kv_pack.py)."""

FP8_MAX = 448.0      # largest e4m3 magnitude
KV_BLOCK = 64        # nope channels per UE8M0 scale
AMAX_FLOOR = 1e-4    # amax clamp: an all-zero block or key still has a finite scale


def entry_bytes(dim: int, rope: int) -> int:
    """Bytes of one packed attention entry of `dim` channels, the last `rope` RoPE'd."""
    nope = dim - rope
    raw = nope + 2 * rope + -(-nope // KV_BLOCK)
    return -(-raw // 8) * 8


def index_key_bytes(dim: int) -> int:
    return dim + 4
