"""Bundled assets: the demo checkpoint served when no model is given."""
from __future__ import annotations

import os

ASSETS = os.path.dirname(os.path.abspath(__file__))
DEMO_DIR = os.path.join(ASSETS, "demo")


def demo_model_dir() -> str:
    """The shipped trained demo model when present, else a random tiny checkpoint made once
    under ~/.cache/dsv4 (with the bundled test tokenizer when available)."""
    if os.path.isfile(os.path.join(DEMO_DIR, "config.json")):
        return DEMO_DIR
    return _random_demo()


def _random_demo() -> str:
    out = os.path.join(os.path.expanduser(os.environ.get("DSV4_CACHE", "~/.cache/dsv4")), "demo-random")
    if not os.path.isfile(os.path.join(out, "config.json")):
        from ..model.random_init import preset_config, random_state, save_checkpoint
        tok_dir = os.path.join(ASSETS, "test_tokenizer")
        vocab = _tokenizer_vocab(tok_dir)
        cfg = preset_config("tiny", **({"vocab_size": vocab} if vocab else {}))
        save_checkpoint(cfg, random_state(cfg, seed=0), out)
        if vocab:
            import shutil
            for name in os.listdir(tok_dir):
                if name.startswith("tokenizer"):
                    shutil.copy(os.path.join(tok_dir, name), out)
    return out


def _tokenizer_vocab(tok_dir: str) -> int | None:
    path = os.path.join(tok_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
