"""The MTP block: a sliding-window block fed e_proj(enorm(embed(x_{t+1}))) + h_proj(hnorm(h_t))
(h_t = the main model's final residual streams), with its own hc_head and norm, sharing the
embedding and the head with the main model. Its SWA keys live in cache layer
`num_hidden_layers + k` (CacheLayout.with_mtp)."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..ops.mhc import hc_head
from .attention import RopeTables
from .deepseek_v4 import Block, DeepseekV4
from .forward_batch import ForwardBatch
from .kv import LayerKV
from .layers import Linear, RMSNorm, param


class MTPBlock(Block):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype,
                 fp8_experts: tuple[bool, bool] = (False, False), mxfp4_experts: bool = False):
        super().__init__(cfg, cfg.num_hidden_layers + index, cfg.mtp_compress_ratio, dtype, fp8_experts,
                         mxfp4_experts)
        n, H = cfg.hc_mult, cfg.hidden_size
        self.e_proj, self.h_proj = Linear(H, H, dtype), Linear(H, H, dtype)
        self.enorm, self.hnorm, self.norm = (RMSNorm(H, cfg.rms_norm_eps) for _ in range(3))
        self.hc_head_fn = param(n, n * H, dtype=torch.float32)
        self.hc_head_base = param(n, dtype=torch.float32)
        self.hc_head_scale = param(1, dtype=torch.float32)

    def draft(self, model: DeepseekV4, h_main: torch.Tensor, fb: ForwardBatch, kv: list[LayerKV]) -> torch.Tensor:
        """h_main [T, N, H] streams at positions t; fb.token_ids = tokens at t+1 -> streams [T, N, H]."""
        e = self.enorm(model.embed(fb.token_ids))
        h = self.e_proj(e).unsqueeze(1) + self.h_proj(self.hnorm(h_main))
        return self(h, fb, kv[self.attn.layer], RopeTables(fb, model.main_freq, model.compress_freq))

    def logits(self, model: DeepseekV4, h: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        x = self.norm(hc_head(h, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.rms_norm_eps, c.hc_eps))
        return torch.nn.functional.linear(x, model.head.weight).float()


def attach_mtp(model: DeepseekV4) -> None:
    """Create the checkpoint's MTP blocks (num_nextn_predict_layers of them) on the model; a
    DSpark checkpoint's `mtp.*` blocks are its draft stages (model/dspark.py)."""
    cfg = model.cfg
    if cfg.dspark_block_size:
        from .dspark import attach_dspark
        return attach_dspark(model)
    for k in range(cfg.num_nextn_predict_layers):
        model.mtp.append(MTPBlock(cfg, k, model.dtype, model.fp8_experts, model.mxfp4_experts))
