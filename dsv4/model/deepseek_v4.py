"""The DeepSeek-V4 model over a flat mixed batch (docs/architecture.md, "Model").

Residual state: hc_mult streams per token, h [T, N, hidden]. Each block: mHC pre ->
RMSNorm -> attention -> mHC post, then the same around the MoE. After the last block:
hc_head -> RMSNorm -> head. Weight names follow DeepSeek's released checkpoints.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.mhc import hc_head, hc_post, hc_pre
from .attention import Attention, RopeTables, SharedTopk
from .forward_batch import ForwardBatch
from .kv import LayerKV
from .layers import RMSNorm, param
from .moe import MoE
from .rope import compress_inv_freq, main_inv_freq
from .vision.step import ImageRows
from .vision.tower import Aligner, ViT


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ratio: int, dtype: torch.dtype,
                 fp8_experts: tuple[bool, bool] = (False, False), mxfp4_experts: bool = False):
        super().__init__()
        self.cfg = cfg
        n, hc_dim = cfg.hc_mult, cfg.hc_mult * cfg.hidden_size
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, ratio, dtype)
        self.ffn = MoE(cfg, layer, dtype, fp8_experts, mxfp4_experts)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", param((2 + n) * n, hc_dim, dtype=torch.float32))
            setattr(self, f"hc_{site}_base", param((2 + n) * n, dtype=torch.float32))
            setattr(self, f"hc_{site}_scale", param(3, dtype=torch.float32))

    def forward(self, h: torch.Tensor, fb: ForwardBatch, kv: LayerKV, rope: RopeTables,
                topk: SharedTopk | None = None, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        x, post, comb = self._pre(h, "attn")
        h = hc_post(self.attn(self.attn_norm(x), fb, kv, rope, topk), h, post, comb)
        x, post, comb = self._pre(h, "ffn")
        return hc_post(self.ffn(self.ffn_norm(x), fb.token_ids, image_mask), h, post, comb)

    def _pre(self, h, site):
        c = self.cfg
        return hc_pre(h, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                      getattr(self, f"hc_{site}_scale"), c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)


class DeepseekV4(nn.Module):
    """fp8_experts = (routed, shared): those expert weights kept FP8 with block scales;
    mxfp4_experts: the routed experts kept MXFP4 (packed e2m1 + E8M0 bytes) instead
    (dsv4/model/moe.py; the loader decides, `load_model(keep_fp8=True, keep_mxfp4=True)`)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 fp8_experts: tuple[bool, bool] = (False, False), mxfp4_experts: bool = False):
        super().__init__()
        self.cfg, self.dtype, self.fp8_experts, self.mxfp4_experts = cfg, dtype, fp8_experts, mxfp4_experts
        n = cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, _freeze=True)
        self.layers = nn.ModuleList(Block(cfg, i, r, dtype, fp8_experts, mxfp4_experts)
                                    for i, r in enumerate(cfg.compress_ratios))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Module()
        self.head.weight = param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.hc_head_fn = param(n, n * cfg.hidden_size, dtype=torch.float32)
        self.hc_head_base = param(n, dtype=torch.float32)
        self.hc_head_scale = param(1, dtype=torch.float32)
        self.register_buffer("main_freq", main_inv_freq(cfg), persistent=False)
        self.register_buffer("compress_freq", compress_inv_freq(cfg), persistent=False)
        self.mtp = nn.ModuleList()  # filled by dsv4.model.mtp.attach_mtp when the checkpoint has it
        if cfg.vision is not None:   # released names: vision.*, aligner.*, image_* (docs/vision.md)
            self.vision, self.aligner = ViT(cfg.vision, dtype), Aligner(cfg.vision, cfg.hidden_size, dtype)
            for name in ("image_start", "image_end", "image_newline", "image_pad"):
                setattr(self, name, param(cfg.hidden_size, dtype=dtype))

    def forward(self, fb: ForwardBatch, kv: list[LayerKV], images: ImageRows | None = None,
                taps: list | None = None) -> torch.Tensor:
        """One step over the batch -> final residual streams [T, N, hidden]. kv[l]: layer l's
        cache views (KVStorage.layers). images: the step's image block rows, whose embeddings
        replace the token embeddings and which the router sends by the vision bias. taps:
        appended, for each of cfg.dspark_target_layer_ids, that layer's input streams averaged
        over hc [T, hidden] (what DSpark reads)."""
        rope, topk = RopeTables(fb, self.main_freq, self.compress_freq), SharedTopk()
        x = self.embed(fb.token_ids)
        mask = None
        if images is not None:
            x, mask = x.index_copy(0, images.rows, images.embeds.to(x.dtype)), images.mask
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for i, block in enumerate(self.layers):
            if taps is not None and i in self.cfg.dspark_target_layer_ids:
                taps.append(h.mean(dim=1))
            h = block(h, fb, kv[i], rope, topk, mask)
        return h

    def sentinels(self) -> torch.Tensor:
        """[5, hidden]: the block embedding of each kind of dsv4/model/vision/grid.py (IMAGE_START,
        IMAGE_PAD, IMAGE (unused: aligner rows go there), IMAGE_NEW_LINE, IMAGE_END)."""
        return torch.stack([self.image_start, self.image_pad, self.image_pad, self.image_newline, self.image_end])

    def set_index_topk_pattern(self, pattern: str) -> None:
        """Switch IndexCache on a built model (it changes no weight; the config check applies):
        only between engines, since a cache written under one pattern lacks indexer keys
        another reads (`ModelConfig.index_topk_producers`)."""
        self.cfg = self.cfg.replace(index_topk_pattern=pattern)
        for block in [*self.layers, *self.mtp]:
            block.cfg = self.cfg
            block.attn.configure_index_topk(self.cfg)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Streams [L, N, hidden] -> fp32 logits [L, vocab]."""
        return self.head_logits(self.head_input(h))

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """Streams [L, N, hidden] -> the normed input of the vocabulary head [L, hidden]."""
        c = self.cfg
        return self.norm(hc_head(h, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.rms_norm_eps,
                                 c.hc_eps))

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[L, hidden] -> fp32 logits [L, vocab]."""
        return torch.nn.functional.linear(x, self.head.weight).float()
