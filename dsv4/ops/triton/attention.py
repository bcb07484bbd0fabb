"""Sparse shared-KV attention with per-head sinks (Triton). Same contract as the reference
`dsv4.ops.attention.sparse_attention`, which is the definition.

One program handles one query token x a block of H_BLOCK heads (all heads of a token share
the same key rows: one shared K=V head). It walks the token's key slots in blocks of BLOCK_K,
first over source 0's index list (W0 slots), then over source 1's (W1 slots; none when there
is one source): together a virtual list of W0 + W1 slots. Rows are gathered straight from the
pools (no copy), masked where the index is -1. Scores are a [H_BLOCK, D] x [D, BLOCK_K] dot,
the softmax is online (running max m and sum l, in log2 units), the output accumulates in
fp32 as [H_BLOCK, D]. (One loop per source, not a per-slot select between two pool pointers:
Triton loses the rows' alignment through a pointer select and falls back to 2-byte loads.)

The sink joins the denominator only: m starts at sink_h (so it is always finite and a token
with no valid key needs no special case: out = 0 / exp2(0)), and exp2(sink_h - m) is added to
l at the end.

Few programs (decode: T * H / H_BLOCK small against the SM count) leave the GPU idle, so the
slot range can also be split across num_splits programs (flash-decoding): each writes its
partial (m, l, acc) and a second kernel merges them and adds the sink.

Each source is a dense [T, W] table or a PagedRows (dsv4/ops/paged.py; W = its width; PAGED0/1
constexpr). A paged source's rows are computed from the page table slot by slot, and its loop
stops at the token's range length hi - lo (early tokens of a prefill chunk skip the blocks past
it); W still sizes the virtual list, so the splits need no host sync. Skipped slots add nothing
to m, l, acc (an all -1 block leaves them unchanged), so the result is bit-identical to the
dense form's. PER_PAGE is a constexpr: a power of two makes the page arithmetic a shift and
mask, and pages of at least BLOCK_K slots (the window's) are read as two scalars a block instead
of a per-slot gather, which keeps the paged loop at the dense one's registers (sm_90).

A packed FP8 pool (dsv4/ops/kv_fp8.py: 448 e4m3 bytes, 64 bf16 RoPE values, 7 UE8M0 scale bytes
on V4) is read as int32 words, two a load (rows are 8-byte aligned), and unpacked in registers
(dsv4/ops/triton/fp8_words.py); q and acc are then split at channel NOPE (`_attend_split`), so
a packed key costs the plain key's dots plus one dequantisation, on the same grid and splits.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..kv_fp8 import entry_bytes
from ..paged import PagedRows
from .attention_rows import INTERPRETING, LOG2E, _block_rows
from .fp8_words import bf16_words_to, fp8_words_to, ue8m0_to

@triton.jit
def _softmax_step(s, valid, m, l):
    """Masked scores s [H_BLOCK, BLOCK_K] (log2 units) into the running (m, l): -> p, alpha, m, l."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])                                             # unused slots: 0
    return p, alpha, m_new, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _attend(q, m, l, acc, kv_ptr, idx_ptr, stride_kv, lo, hi, qk_scale, dims, d_ok,
            base, pitch, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
            PAGED: tl.constexpr, PER_PAGE: tl.constexpr):
    """Online softmax of one token's q [H_BLOCK, BLOCK_D] over its key slots [lo, hi) of one
    source of model-dtype rows, a slot naming a row of the pool kv_ptr (-1: unused; rows:
    `_block_rows`). Carries m, l [H_BLOCK] (log2 units) and acc [H_BLOCK, BLOCK_D] fp32."""
    for start in range(lo, hi, BLOCK_K):
        idx = _block_rows(idx_ptr, start, hi, base, pitch, BLOCK_K, PAGED, PER_PAGE)
        valid = idx >= 0                                                            # [BLOCK_K]
        k = tl.load(kv_ptr + idx[:, None] * stride_kv + dims[None, :],
                    mask=valid[:, None] & d_ok[None, :], other=0.0)                 # [BLOCK_K, BLOCK_D]
        if FP32_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee" if FP32_DOT else "tf32") * qk_scale  # [H_BLOCK, BLOCK_K]
        p, alpha, m, l = _softmax_step(s, valid, m, l)
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision="ieee" if FP32_DOT else "tf32")
    return m, l, acc


@triton.jit
def _split_keys(kv_ptr, idx, valid, stride_kv, dtype: tl.constexpr, PACKED: tl.constexpr,
                NOPE: tl.constexpr, ROPE: tl.constexpr, NOPE_P: tl.constexpr, ROPE_P: tl.constexpr):
    """The rows idx [BLOCK_K] of a pool as (no-RoPE part [BLOCK_K, NOPE_P], RoPE part [BLOCK_K,
    ROPE_P]) in dtype, zero past NOPE / ROPE and on invalid rows. PACKED: FP8 rows (dsv4/ops/
    kv_fp8.py) read as int32 words (rows 8-byte aligned: two words a load) and unpacked in
    registers, the nope words times their block's UE8M0 scale (exact: a power of two)."""
    if PACKED:
        row = kv_ptr.to(tl.pointer_type(tl.int32)) + tl.multiple_of(idx * (stride_kv // 4), 2)   # [BLOCK_K]
        w = tl.arange(0, NOPE_P // 4)                                               # 4 nope bytes a word
        raw = tl.load(row[:, None] + w[None, :], mask=valid[:, None] & (w < NOPE // 4)[None, :], other=0)
        sb = tl.arange(0, NOPE_P // 64)                                             # scale bytes
        code = tl.load((kv_ptr + idx * stride_kv + (NOPE + 2 * ROPE))[:, None] + sb[None, :],
                       mask=valid[:, None] & (sb < (NOPE + 63) // 64)[None, :], other=127)
        work: tl.constexpr = tl.bfloat16 if dtype == tl.bfloat16 else tl.float32   # value x scale exact in it
        vals = tl.reshape(fp8_words_to(raw, work), (idx.shape[0], NOPE_P // 64, 64))  # [BLOCK_K, blocks, 64]
        vals = vals * ue8m0_to(code, work)[:, :, None]                              # times each block's scale
        k_a = tl.reshape(vals, (idx.shape[0], NOPE_P)).to(dtype)
        r = tl.arange(0, ROPE_P // 2)                                               # 2 bf16 a word
        roped = tl.load(row[:, None] + NOPE // 4 + r[None, :], mask=valid[:, None] & (r < ROPE // 2)[None, :],
                        other=0)
        k_b = bf16_words_to(roped, work).to(dtype)
    else:
        da, db = tl.arange(0, NOPE_P), tl.arange(0, ROPE_P)
        row = kv_ptr + idx * stride_kv
        k_a = tl.load(row[:, None] + da[None, :], mask=valid[:, None] & (da < NOPE)[None, :], other=0.0).to(dtype)
        k_b = tl.load(row[:, None] + NOPE + db[None, :], mask=valid[:, None] & (db < ROPE)[None, :],
                      other=0.0).to(dtype)
    return k_a, k_b


@triton.jit
def _attend_split(q_a, q_b, m, l, acc_a, acc_b, kv_ptr, idx_ptr, stride_kv, lo, hi, qk_scale, base, pitch,
                  BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr, PAGED: tl.constexpr, PER_PAGE: tl.constexpr,
                  PACKED: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, NOPE_P: tl.constexpr,
                  ROPE_P: tl.constexpr):
    """`_attend` with q, acc split at channel NOPE (q_a, acc_a [H_BLOCK, NOPE_P]: channels
    [0, NOPE); q_b, acc_b [H_BLOCK, ROPE_P]: channels NOPE + [0, ROPE)), the form a packed FP8
    row unpacks to: per key the same dots as the plain form plus one dequantisation in
    registers. Either kind of pool (PACKED or not) reads into it."""
    prec: tl.constexpr = "ieee" if FP32_DOT else "tf32"
    for start in range(lo, hi, BLOCK_K):
        idx = _block_rows(idx_ptr, start, hi, base, pitch, BLOCK_K, PAGED, PER_PAGE)
        valid = idx >= 0                                                            # [BLOCK_K]
        k_a, k_b = _split_keys(kv_ptr, idx, valid, stride_kv, q_a.dtype, PACKED, NOPE, ROPE, NOPE_P, ROPE_P)
        s = (tl.dot(q_a, tl.trans(k_a), input_precision=prec)
             + tl.dot(q_b, tl.trans(k_b), input_precision=prec)) * qk_scale        # [H_BLOCK, BLOCK_K]
        p, alpha, m, l = _softmax_step(s, valid, m, l)
        p = p.to(k_a.dtype)
        acc_a = acc_a * alpha[:, None] + tl.dot(p, k_a, input_precision=prec)
        acc_b = acc_b * alpha[:, None] + tl.dot(p, k_b, input_precision=prec)
    return m, l, acc_a, acc_b


@triton.jit
def _slots(idx_ptr, req_ptr, lo_ptr, hi_ptr, stride_i, t, W, PAGED: tl.constexpr):
    """One source's table row for token t, the item of its slot 0 and its slot count."""
    if PAGED:
        base = tl.load(lo_ptr + t).to(tl.int32)
        n = tl.minimum(tl.maximum(tl.load(hi_ptr + t).to(tl.int32) - base, 0), W)
        row_ptr = idx_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_i
    else:
        base = 0
        n = W
        row_ptr = idx_ptr + t * stride_i
    return row_ptr, base, n


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("W0", "W1", "num_splits", "slots_per_split", "stride_i0", "stride_i1", "pitch0", "pitch1"))
def _sparse_attn_kernel(
        q_ptr, sink_ptr, out_ptr,                  # q [T, H, D], sinks [H], out [T, H, D]
        kv0_ptr, idx0_ptr, req0_ptr, lo0_ptr, hi0_ptr,  # pools [N, D] (row stride); dense: idx [T, W] (last
        kv1_ptr, idx1_ptr, req1_ptr, lo1_ptr, hi1_ptr,  # dim contiguous); paged: pages [R, P] (same), req/lo/hi [T]
        m_ptr, l_ptr, part_ptr,                    # split partials: m, l [T, H, S], acc [T, H, S, D] fp32
        H, W0, W1, num_splits, slots_per_split,    # grid: (T * cdiv(H, H_BLOCK), num_splits)
        qk_scale,                                  # scale * log2(e)
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kv0, stride_i0, stride_kv1, stride_i1, pitch0, pitch1,
        D: tl.constexpr, H_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
        SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,  # SPLIT: num_splits > 1, write partials
        PAGED0: tl.constexpr, PER_PAGE0: tl.constexpr, PAGED1: tl.constexpr, PER_PAGE1: tl.constexpr,
        PACKED0: tl.constexpr, PACKED1: tl.constexpr,     # packed FP8 pools: split form (`_attend_split`)
        NOPE: tl.constexpr, ROPE: tl.constexpr, NOPE_P: tl.constexpr, ROPE_P: tl.constexpr):
    n_hb = tl.cdiv(H, H_BLOCK)
    pid = tl.program_id(0)                      # token-major: the head blocks of a token are adjacent (L2 reuse)
    t = (pid // n_hb).to(tl.int64)
    heads = (pid % n_hb) * H_BLOCK + tl.arange(0, H_BLOCK)
    h_ok = heads < H
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh                        # [H_BLOCK, 1]
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
    m = sink                                            # [H_BLOCK] running max (log2 units), >= sink
    l = tl.zeros([H_BLOCK], dtype=tl.float32)           # [H_BLOCK] sum of exp2(s - m) over keys

    # this program's slots [first, last) of the virtual list: W0 slots of source 0, then W1 of source 1;
    # a paged source's slots past its range's length are skipped (n0, n1 <= W0, W1)
    first = tl.program_id(1) * slots_per_split
    last = tl.minimum(first + slots_per_split, W0 + W1)
    row0, base0, n0 = _slots(idx0_ptr, req0_ptr, lo0_ptr, hi0_ptr, stride_i0, t, W0, PAGED0)
    row1, base1, n1 = _slots(idx1_ptr, req1_ptr, lo1_ptr, hi1_ptr, stride_i1, t, W1, PAGED1)
    lo1, hi1 = tl.maximum(first, W0) - W0, tl.minimum(last - W0, n1)
    if PACKED0 or PACKED1:      # channels split at NOPE (the packed rows' form), both sources read into it
        da, db = tl.arange(0, NOPE_P), tl.arange(0, ROPE_P)
        a_ok, b_ok = da < NOPE, db < ROPE
        q_a = tl.load(q_row + da[None, :], mask=h_ok[:, None] & a_ok[None, :], other=0.0)
        q_b = tl.load(q_row + NOPE + db[None, :], mask=h_ok[:, None] & b_ok[None, :], other=0.0)
        if FP32_DOT:
            q_a, q_b = q_a.to(tl.float32), q_b.to(tl.float32)
        acc_a = tl.zeros([H_BLOCK, NOPE_P], dtype=tl.float32)
        acc_b = tl.zeros([H_BLOCK, ROPE_P], dtype=tl.float32)
        m, l, acc_a, acc_b = _attend_split(q_a, q_b, m, l, acc_a, acc_b, kv0_ptr, row0, stride_kv0, first,
                                           tl.minimum(last, n0), qk_scale, base0, pitch0, BLOCK_K, FP32_DOT,
                                           PAGED0, PER_PAGE0, PACKED0, NOPE, ROPE, NOPE_P, ROPE_P)
        m, l, acc_a, acc_b = _attend_split(q_a, q_b, m, l, acc_a, acc_b, kv1_ptr, row1, stride_kv1, lo1, hi1,
                                           qk_scale, base1, pitch1, BLOCK_K, FP32_DOT,
                                           PAGED1, PER_PAGE1, PACKED1, NOPE, ROPE, NOPE_P, ROPE_P)
        _write(acc_a, da, a_ok, m, l, sink, t, heads, h_ok, out_ptr, part_ptr, H, num_splits,
               stride_ot, stride_oh, D, SPLIT)
        _write(acc_b, NOPE + db, b_ok, m, l, sink, t, heads, h_ok, out_ptr, part_ptr, H, num_splits,
               stride_ot, stride_oh, D, SPLIT)
    else:
        dims = tl.arange(0, BLOCK_D)
        d_ok = dims < D
        q = tl.load(q_row + dims[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        if FP32_DOT:
            q = q.to(tl.float32)
        acc = tl.zeros([H_BLOCK, BLOCK_D], dtype=tl.float32)
        m, l, acc = _attend(q, m, l, acc, kv0_ptr, row0, stride_kv0, first, tl.minimum(last, n0), qk_scale,
                            dims, d_ok, base0, pitch0, BLOCK_K, FP32_DOT, PAGED0, PER_PAGE0)
        m, l, acc = _attend(q, m, l, acc, kv1_ptr, row1, stride_kv1, lo1, hi1, qk_scale, dims, d_ok,
                            base1, pitch1, BLOCK_K, FP32_DOT, PAGED1, PER_PAGE1)
        _write(acc, dims, d_ok, m, l, sink, t, heads, h_ok, out_ptr, part_ptr, H, num_splits,
               stride_ot, stride_oh, D, SPLIT)
    if SPLIT:
        row = (t * H + heads) * num_splits + tl.program_id(1)      # [H_BLOCK] rows of [T, H, S]
        tl.store(m_ptr + row, m, mask=h_ok)
        tl.store(l_ptr + row, l, mask=h_ok)


@triton.jit
def _write(acc, cols, col_ok, m, l, sink, t, heads, h_ok, out_ptr, part_ptr, H, num_splits,
           stride_ot, stride_oh, D: tl.constexpr, SPLIT: tl.constexpr):
    """Channels `cols` of a program's result: acc [H_BLOCK, len(cols)] normalised into out, or
    (SPLIT) as is into its split's partial row."""
    ok = h_ok[:, None] & col_ok[None, :]
    if not SPLIT:
        out = acc / (l + tl.exp2(sink - m))[:, None]
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        row = (t * H + heads) * num_splits + tl.program_id(1)      # [H_BLOCK] rows of [T, H, S]
        tl.store(part_ptr + row[:, None] * D + cols[None, :], acc, mask=ok)


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("num_splits",))
def _merge_splits_kernel(
        m_ptr, l_ptr, part_ptr, sink_ptr, out_ptr,  # partials as above, sinks [H], out [T, H, D]
        H, num_splits, stride_ot, stride_oh,
        D: tl.constexpr, H_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    # program = token x head block x BLOCK_D channels (grid axis 1): a decode step has only
    # T * H / H_BLOCK head blocks, and each one's splits are read one after another, so the
    # channels are spread too (many splits at long contexts must not serialise on 4 programs)
    n_hb = tl.cdiv(H, H_BLOCK)
    pid = tl.program_id(0)
    t = (pid // n_hb).to(tl.int64)
    heads = (pid % n_hb) * H_BLOCK + tl.arange(0, H_BLOCK)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    h_ok, d_ok = heads < H, dims < D
    hd_ok = h_ok[:, None] & d_ok[None, :]
    rows = (t * H + heads) * num_splits

    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
    m = sink                                    # every split's m is >= sink, so m_max is finite
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(m_ptr + rows + s, mask=h_ok, other=0.0))
    l = tl.exp2(sink - m)
    acc = tl.zeros([H_BLOCK, BLOCK_D], dtype=tl.float32)
    for s in range(num_splits):
        w = tl.exp2(tl.load(m_ptr + rows + s, mask=h_ok, other=0.0) - m)
        l += w * tl.load(l_ptr + rows + s, mask=h_ok, other=0.0)
        acc += w[:, None] * tl.load(part_ptr + (rows + s)[:, None] * D + dims[None, :], mask=hd_ok, other=0.0)
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=hd_ok)


INDEX_DTYPES = (torch.int32, torch.int64)


def _index_ok(idx: torch.Tensor | PagedRows, T: int) -> bool:
    if isinstance(idx, PagedRows):
        return (idx.pages.dim() == 2 and idx.pages.dtype in INDEX_DTYPES and idx.per_page >= 1 and idx.width >= 0
                and all(v.dim() == 1 and v.shape[0] == T and v.dtype in INDEX_DTYPES
                        for v in (idx.req, idx.lo, idx.hi)))
    return idx.dim() == 2 and idx.shape[0] == T and idx.dtype in INDEX_DTYPES


def _pool_ok(kv: torch.Tensor, q: torch.Tensor, rope_dims: int) -> bool:
    """A pool of q's dtype and width, or packed FP8 rows of q's width (with rope_dims > 0)."""
    if kv.dim() != 2 or kv.stride(1) != 1:
        return False
    if kv.dtype == torch.uint8:     # read as int32 words, two a load: whole words, 8-byte aligned rows
        nope = q.shape[2] - rope_dims
        return (0 < rope_dims < q.shape[2] and kv.shape[1] == entry_bytes(q.shape[2], rope_dims)
                and nope % 4 == 0 and rope_dims % 2 == 0 and kv.stride(0) % 8 == 0 and kv.data_ptr() % 8 == 0)
    return kv.dtype == q.dtype and kv.shape[1] == q.shape[2]


def supports(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor | PagedRows]],
             sinks: torch.Tensor, rope_dims: int = 0) -> bool:
    """Inputs the kernel takes; anything else goes to the reference. One or two sources, pools
    of q's dtype (fp32/fp16/bf16) or packed FP8 rows (rope_dims: the RoPE'd channels) with
    contiguous rows (pools are never copied), each indexed by a dense table or a PagedRows."""
    return (q.dim() == 3 and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and 1 <= len(sources) <= 2 and sinks.shape == (q.shape[1],)
            and all(_pool_ok(kv, q, rope_dims) and _index_ok(idx, q.shape[0]) for kv, idx in sources))


def _source_args(kv: torch.Tensor, idx: torch.Tensor | PagedRows) -> tuple:
    """A source's kernel arguments: (kv, table, req, lo, hi, table row stride, pitch), (W, paged,
    per_page). A dense source passes its table for the unused req/lo/hi."""
    if isinstance(idx, PagedRows):
        pages = idx.pages if idx.pages.stride(1) == 1 else idx.pages.contiguous()
        req, lo, hi = (v.contiguous() for v in (idx.req, idx.lo, idx.hi))
        return (kv, pages, req, lo, hi, pages.stride(0), idx.pitch), (idx.width, True, idx.per_page)
    idx = idx if idx.stride(1) == 1 else idx.contiguous()
    return (kv, idx, idx, idx, idx, idx.stride(0), 1), (idx.shape[1], False, 1)


def _split_widths(nope: int, rope: int) -> tuple[int, int]:
    """Padded widths of the split form (`_attend_split`): whole 64-channel scale blocks (a power
    of two of them) and a power of two of RoPE channels, >= 16 (tl.dot's smallest)."""
    return 64 * triton.next_power_of_2(max(1, triton.cdiv(nope, 64))), max(16, triton.next_power_of_2(max(1, rope)))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(q: torch.Tensor, programs: int, slot_blocks: int) -> int:
    """Split the slots when one wave of programs would leave SMs idle; keep >= 2 blocks a split."""
    if not q.is_cuda:
        return 1
    sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(sms, programs), slot_blocks // 2))


# Tiles (h_block, block_k, num_warps, num_stages) from the H200 runs of benchmarks/kernels/
# attention.py: 64 heads per program halves long prefills (2.3 vs 4.4 ms at 4k), 64 keys per
# step takes it to 1.79 ms; for decode-size batches the candidates were within run-to-run
# noise, so the register-checked default stays.
PREFILL_TILES, DECODE_TILES, PREFILL_FROM = (64, 64, 8, 2), (16, 32, 8, 2), 1024
# A step of LONG_MIN_TOKENS tokens or more over a long slot list (an HCA layer deep in a prompt:
# ~7k C128 entries at 900k) takes 128 keys a step over 32 heads and 4 warps: a 2,048-token chunk
# at 900k 9.7 against 14.0 ms with the prefill tile; 512 tokens 2.5 against 8.0 ms and 256 tokens
# 1.3 against 4.2 ms with the decode tile (`python -m benchmarks.kernels.attention --deep-hca
# --deep-short`, H200)
LONG_TILES, LONG_FROM, LONG_MIN_TOKENS = (32, 128, 4, 2), 2048, 256
# Where LONG_TILES would run (bf16 pools: packed FP8 ones keep this file's kernel) and every source
# is a PagedRows, another kernel takes the step: "wgmma" (attention_wgmma.py, Gluon, sm_90 with D =
# 512 and heads a multiple of 64: one token x 64 heads a program, the two warp groups splitting
# S's keys and O's channels; 5.35 against 7.77 ms an HCA layer of the 2,048-token chunk at 900k
# on an H100, docs/benchmarks.md "Sixteenth session"; elsewhere "shared"'s kernel), "shared"
# (attention_shared.py: 2 tokens x 64 heads a program over the union of their ranges, the output
# channels split, every dot a Hopper wgmma, the keys by cp.async; 7.24 against 9.54 ms on the
# H200, call 2 of the twelfth session). None: this file's per-token kernel. `python -m
# benchmarks.kernels.attention --variants` times them.
LONG_KERNEL: str | None = "wgmma"
MERGE_BLOCK_D = 64              # channels per program of the split merge (D = 512: 8 programs a head block)


def _default_tiles(q: torch.Tensor, slots: int, pools: list[torch.Tensor]) -> tuple[int, int, int, int]:
    """(h_block, block_k, num_warps, num_stages) by step size and slot-list width. fp32 (checks
    only) keeps the decode tiles: the prefill tile's q and keys would need 273 KB of shared memory;
    packed FP8 pools keep the prefill tile (the long one is measured on model-dtype rows only)."""
    if q.dtype == torch.float32 or q.shape[0] < LONG_MIN_TOKENS:
        return DECODE_TILES
    if slots >= LONG_FROM and all(kv.dtype == q.dtype for kv in pools):
        return LONG_TILES
    return DECODE_TILES if q.shape[0] < PREFILL_FROM else PREFILL_TILES


def _long_kernel(q: torch.Tensor, sources: list, sinks: torch.Tensor):
    """LONG_KERNEL's entry point where it takes these inputs in place of LONG_TILES, else None."""
    from . import attention_shared
    slots = sum(idx.width if isinstance(idx, PagedRows) else idx.shape[1] for _, idx in sources)
    if (_default_tiles(q, slots, [kv for kv, _ in sources]) != LONG_TILES
            or not attention_shared.supports_shared(q, sources, sinks)):
        return None
    assert LONG_KERNEL in ("shared", "wgmma"), "LONG_KERNEL: 'shared', 'wgmma' or None"
    if LONG_KERNEL == "wgmma":        # attention_wgmma.py's kernel where it takes these inputs
        from . import attention_wgmma
        if attention_wgmma.supports_wgmma(q, sources, sinks):
            return attention_wgmma.wgmma_attention
    return attention_shared.shared_attention


def sparse_attention(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor | PagedRows]],
                     sinks: torch.Tensor, scale: float, *, rope_dims: int = 0, h_block: int | None = None,
                     block_k: int | None = None,
                     num_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> torch.Tensor:
    """q [T, H, D]; sources [(kv [N, D], idx [T, K] or PagedRows of width K)] (one or two; idx
    -1 = unused slot); sinks [H] (finite) -> out [T, H, D] in q's dtype. Keyword arguments are
    tuning knobs (tests and benchmarks); `num_splits=None` splits the slots when T is small
    (CUDA only). No host sync (CUDA graphs): a PagedRows' width, per_page and pitch are ints.
    Defaults (D = 512, bf16, sm_90, Triton 3.9 ahead-of-time): 103 registers, no spills, 50 KB
    of shared memory; the keys go through cp.async. benchmarks/kernels/attention.py times others."""
    assert supports(q, sources, sinks, rope_dims), "sparse_attention (triton): unsupported inputs, use the reference"
    if LONG_KERNEL is not None and all(k is None for k in (h_block, block_k, num_splits, num_warps, num_stages)):
        long_kernel = _long_kernel(q, sources, sinks)
        if long_kernel is not None:
            return long_kernel(q, sources, sinks, scale)
    T, H, D = q.shape
    out = torch.empty_like(q)
    if T == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    sinks = sinks.contiguous()
    args0, (W0, paged0, per_page0) = _source_args(*sources[0])
    if len(sources) == 2:
        args1, (W1, paged1, per_page1) = _source_args(*sources[1])
    else:                                                    # one source: W1 = 0, never read
        args1, (W1, paged1, per_page1) = args0, (0, False, 1)
    h_block, block_k, num_warps, num_stages = (given if given is not None else default for given, default in
                                               zip((h_block, block_k, num_warps, num_stages),
                                                   _default_tiles(q, W0 + W1, [kv for kv, _ in sources])))

    h_block = max(16, min(h_block, triton.next_power_of_2(H)))   # tl.dot needs >= 16 rows
    n_hb = triton.cdiv(H, h_block)
    slot_blocks = triton.cdiv(W0 + W1, block_k)
    splits = num_splits or _default_splits(q, T * n_hb, slot_blocks)
    blocks_per_split = max(1, triton.cdiv(slot_blocks, max(1, min(splits, slot_blocks))))
    splits = max(1, triton.cdiv(slot_blocks, blocks_per_split))      # no empty split
    slots_per_split = blocks_per_split * block_k
    if splits > 1:
        m = torch.empty((T, H, splits), device=q.device, dtype=torch.float32)
        l = torch.empty_like(m)
        part = torch.empty((T, H, splits, D), device=q.device, dtype=torch.float32)
    else:
        m = l = part = out                                   # unused by the kernel
    block_d = triton.next_power_of_2(D)
    nope_p, rope_p = _split_widths(D - rope_dims, rope_dims)
    (kv0, idx0, req0, lo0, hi0, stride_i0, pitch0), (kv1, idx1, req1, lo1, hi1, stride_i1, pitch1) = args0, args1
    _sparse_attn_kernel[(T * n_hb, splits)](
        q, sinks, out, kv0, idx0, req0, lo0, hi0, kv1, idx1, req1, lo1, hi1, m, l, part,
        H, W0, W1, splits, slots_per_split, scale * LOG2E.value,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv0.stride(0), stride_i0, kv1.stride(0), stride_i1, pitch0, pitch1,
        D=D, H_BLOCK=h_block, BLOCK_K=block_k, BLOCK_D=block_d, SPLIT=splits > 1,
        FP32_DOT=q.dtype == torch.float32 or INTERPRETING,
        PAGED0=paged0, PER_PAGE0=per_page0, PAGED1=paged1, PER_PAGE1=per_page1,
        PACKED0=kv0.dtype == torch.uint8, PACKED1=kv1.dtype == torch.uint8, NOPE=D - rope_dims, ROPE=rope_dims,
        NOPE_P=nope_p, ROPE_P=rope_p,
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        merge_d = min(block_d, MERGE_BLOCK_D)
        _merge_splits_kernel[(T * n_hb, triton.cdiv(D, merge_d))](
            m, l, part, sinks, out, H, splits, out.stride(0), out.stride(1),
            D=D, H_BLOCK=h_block, BLOCK_D=merge_d, num_warps=4)
    return out
