"""Install a built demo checkpoint as the package's bundled model (dsv4/assets/demo), its
shards merged into one model.safetensors:

    python -m scripts.demo.ship OUT/model [--extra OUT/data]

`--extra` supplies tokenizer.json, tokenizer_config.json and heldout.json when the model folder
lacks them (e.g. a GPU run that sent back only the weights)."""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from safetensors.torch import load_file, save_file


from dsv4.assets import DEMO_DIR
from dsv4.model.weights import shard_files

FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "heldout.json")


def ship(model_dir: str, extra_dir: str | None = None, dest: str = DEMO_DIR) -> None:
    tensors = {}
    for file in shard_files(model_dir):
        tensors.update(load_file(file))
    sources = {}
    for name in FILES:
        found = [d for d in (model_dir, extra_dir) if d and os.path.isfile(os.path.join(d, name))]
        if not found:
            raise FileNotFoundError(f"{name} is in neither {model_dir!r} nor {extra_dir!r}")
        sources[name] = os.path.join(found[0], name)
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    os.makedirs(dest)
    save_file(tensors, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    for name, src in sources.items():
        shutil.copy(src, os.path.join(dest, name))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--extra", help="folder with the tokenizer and heldout.json")
    p.add_argument("--dest", default=DEMO_DIR)
    args = p.parse_args(argv)
    ship(args.model_dir, args.extra, args.dest)
    size = sum(os.path.getsize(os.path.join(args.dest, n)) for n in os.listdir(args.dest))
    print(f"{args.dest}: {sorted(os.listdir(args.dest))}, {size / 2 ** 20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
