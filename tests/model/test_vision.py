"""The vision tower and its inputs (docs/vision.md): config fields, the grid and block layout,
the tower + aligner against the plain reference (dsv4/model/vision/reference.py), Pillow
preprocessing of PNG / JPEG / WebP / GIF, bad images, and the router's vision bias."""
from __future__ import annotations

import pytest
import torch

from dsv4.config import ConfigError, ModelConfig
from dsv4.model.random_init import preset_config, random_state
from dsv4.model.vision.grid import (COMPRESS_PAD_TO, IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_START,
                                    block_layout, block_length, image_grid)
from dsv4.model.vision.preprocess import ImageError, grid_of, open_image, to_patches
from dsv4.model.vision.reference import reference_aligner, reference_vit
from dsv4.model.vision.tower import Aligner, ViT, assemble_block, encode_images
from vision_images import encoded, noise, png, png_header_claiming

CFG = preset_config("tiny-vision")
V = CFG.vision
RELEASED = dict(patch=14, ratio=3, max_n_token=384, min_pixels=147456, max_wh_ratio=8.0)


# ---- config -----------------------------------------------------------------------------------
def test_vision_config_fields_round_trip_and_text_only_has_none():
    d = CFG.to_released_dict()
    assert d["vision_dim"] == 32 and d["vision_downsample_ratio"] == 2 and d["image_token_id"] == 511
    assert ModelConfig.from_dict(d).vision == V
    assert preset_config("tiny").vision is None


@pytest.mark.parametrize("field, value", [("vision_dim", None), ("vision_patch_size", 0),
                                          ("vision_n_heads", 3), ("vision_rope_theta", "x"),
                                          ("image_token_id", 9999)])
def test_bad_vision_fields_name_the_field(field, value):
    d = CFG.to_released_dict()
    if value is None:
        del d[field]
    else:
        d[field] = value
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(d)
    assert e.value.field == field


# ---- grid and block ---------------------------------------------------------------------------
@pytest.mark.parametrize("h, w", [(1, 1), (10, 10), (384, 384), (1080, 1920), (4000, 300), (300, 4000),
                                  (14, 5000), (5000, 14), (777, 1234)])
def test_released_grids_fit_the_budget_and_aligner(h, w):
    n_vh, n_vw, n_lh, n_lw = image_grid(h, w, **RELEASED)
    assert n_lh == -(-n_vh // 3) and n_lw == -(-n_vw // 3)
    for start in range(4):
        assert block_length(n_lh, n_lw, start) <= RELEASED["max_n_token"]


def test_square_released_image_uses_most_of_the_budget():
    n_vh, n_vw, n_lh, n_lw = image_grid(1024, 1024, **RELEASED)
    # 3 pads, start, 18 rows of 19, 2 pads (9 row pairs of 19 columns: odd), end
    assert (n_lh, n_lw) == (18, 18) and block_length(18, 18, 0) == 3 + 1 + 18 * 19 + 2 + 1


@pytest.mark.parametrize("n_h, n_w", [(1, 1), (2, 3), (3, 2), (4, 4), (5, 7), (6, 1)])
@pytest.mark.parametrize("start", [0, 1, 2, 3, 17])
def test_block_layout(n_h, n_w, start):
    types, perm = block_layout(n_h, n_w, start)
    assert len(types) == block_length(n_h, n_w, start)
    s = int((types == IMAGE_START).nonzero())
    assert (start + s) % COMPRESS_PAD_TO == COMPRESS_PAD_TO - 1 and (types[:s] == IMAGE_PAD).all()
    assert types[-1] == IMAGE_END and (types == IMAGE_NEW_LINE).sum() == n_h
    assert sorted(perm.tolist()) == list(range(n_h * n_w)) and (types == IMAGE).sum() == n_h * n_w
    assert (len(types) - s - 1) % 4 == 1    # the grid part fills whole groups of four


def test_block_is_in_n_order():
    """2 x 2 grid: row 0 col 0, row 1 col 0, row 0 col 1, row 1 col 1, both newlines, then two pads
    (3 columns of a row pair: odd)."""
    types, perm = block_layout(2, 2, 0)
    assert types.tolist() == [IMAGE_PAD] * 3 + [IMAGE_START, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE_NEW_LINE,
                                                IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_PAD, IMAGE_END]
    assert perm.tolist() == [0, 2, 1, 3]


# ---- tower + aligner vs the reference ----------------------------------------------------------
@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    state = random_state(CFG, with_mtp=False)
    vit, aligner = ViT(V, torch.float32), Aligner(V, CFG.hidden_size, torch.float32)
    vit.load_state_dict({k[7:]: v for k, v in state.items() if k.startswith("vision.")})
    aligner.load_state_dict({k[8:]: v for k, v in state.items() if k.startswith("aligner.")})
    return vit, aligner


@pytest.mark.parametrize("size", [(32, 32), (40, 30), (20, 70), (100, 12)])
@torch.no_grad()
def test_tower_and_aligner_match_the_reference(tower, size):
    vit, aligner = tower
    patches, g = to_patches(open_image(png(*size)), V)
    ours = encode_images(vit, aligner, patches[None], g.n_vit_h, g.n_vit_w)[0]
    ref = reference_aligner(aligner, reference_vit(vit, patches, g.n_vit_h, g.n_vit_w), g.n_vit_h, g.n_vit_w)
    assert ours.shape == (g.n_llm_h * g.n_llm_w, CFG.hidden_size)
    assert torch.allclose(ours.double(), ref, atol=1e-4 * float(ref.abs().max())), (ours.double() - ref).abs().max()


def test_a_batch_of_images_equals_each_alone(tower):
    vit, aligner = tower
    batch = torch.stack([to_patches(open_image(png(32, 32, s)), V)[0] for s in range(3)])
    together = encode_images(vit, aligner, batch, 8, 8)
    for i in range(3):
        assert torch.allclose(together[i], encode_images(vit, aligner, batch[i:i + 1], 8, 8)[0], atol=1e-5)
    assert not torch.allclose(together[0], together[1])


def test_block_assembly_puts_sentinels_and_rows_where_the_layout_says():
    rows, sentinels = torch.randn(6, 4), torch.randn(5, 4)
    block = assemble_block(rows, sentinels, 2, 3, start=2)
    types, perm = block_layout(2, 3, 2)
    assert torch.equal(block[types == IMAGE], rows[perm])
    for kind in (IMAGE_START, IMAGE_PAD, IMAGE_NEW_LINE, IMAGE_END):
        assert torch.equal(block[types == kind], sentinels[kind].expand(int((types == kind).sum()), -1))


# ---- preprocessing -----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_formats_decode_to_the_same_grid(fmt):
    img = open_image(encoded(noise(40, 30), fmt))
    patches, g = to_patches(img, V)
    assert patches.shape == (g.n_vit_h * g.n_vit_w, 3, 4, 4) and patches.abs().max() <= 1.0
    assert g == grid_of(open_image(png(40, 30)), V)


def test_gif_gives_its_first_frame():
    from PIL import Image
    frames = [Image.new("RGB", (32, 32), c) for c in ((255, 0, 0), (0, 0, 255))]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    patches, _ = to_patches(open_image(data), V)
    assert torch.allclose(patches[:, 0], torch.ones(1)) and torch.allclose(patches[:, 2], -torch.ones(1))


def test_normalisation_and_gray_padding():
    """A white 40 x 16 image (scaled up to 50 x 20, padded into a 52 x 20 grid): 1.0 inside,
    (127/255 - 0.5) / 0.5 outside."""
    from PIL import Image
    img = Image.new("RGB", (40, 16), (255, 255, 255))
    patches, g = to_patches(img, V)
    values = set(torch.unique(patches).tolist())
    assert 1.0 in values and any(abs(v - (127 / 255 - 0.5) / 0.5) < 1e-6 for v in values)


@pytest.mark.parametrize("data, words", [
    (b"", "empty"),
    (b"not an image at all", "cannot be decoded"),
    (png(40, 30)[:60], "cannot be decoded"),
    (png_header_claiming(10000, 10000), "megapixels"),
    (png_header_claiming(0, 10), "cannot be decoded"),
])
def test_bad_images_say_what_is_wrong(data, words):
    with pytest.raises(ImageError, match=words):
        patches, _ = to_patches(open_image(data), V)


# ---- the router's vision bias ------------------------------------------------------------------
@pytest.mark.parametrize("layer", [0, 1])     # layer 0 is a hash layer
def test_image_rows_route_by_score_plus_bias_vl(layer):
    from dsv4.model.moe import Gate
    from dsv4.ops.moe import route_topk
    torch.manual_seed(layer)
    gate = Gate(CFG, CFG.is_hash_layer(layer), torch.float32)
    for p in gate.parameters():
        p.copy_(torch.randn_like(p))
    if gate.is_hash:
        gate.tid2eid.copy_(torch.stack([torch.randperm(CFG.n_routed_experts)[:2] for _ in range(CFG.vocab_size)]))
    x, ids = torch.randn(6, CFG.hidden_size), torch.tensor([5, 511, 511, 7, 511, 9])
    mask = ids == 511
    w_plain, e_plain = gate(x, ids)
    w, e = gate(x, ids, mask)
    w_img, e_img = route_topk(x[mask], gate.weight, gate.bias_vl, CFG.num_experts_per_tok, CFG.routed_scaling_factor)
    assert torch.equal(e[mask], e_img) and torch.equal(w[mask], w_img)
    assert torch.equal(e[~mask], e_plain[~mask]) and torch.equal(w[~mask], w_plain[~mask])
