"""Install trained DSpark stages as the demo model's DSpark draft folder (dsv4/assets/demo/dspark,
docs/demo-model.md): only the stages' tensors (`mtp.*`, as trained: bf16, fp32 where the released
format keeps fp32), the trainer's config (the demo's plus the DSpark fields) and its loss curve.
`--speculative-config '{"method": "dspark", ...}'` on the demo loads them in place of its MTP layer
(dsv4/model/draft.py `load_dspark_draft`).

    python -m scripts.demo.ship_dspark TRAINED [--dest DIR]

TRAINED is the folder `python -m scripts.demo.train_dspark --out TRAINED` wrote."""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from safetensors.torch import load_file, save_file

from dsv4.assets import DEMO_DIR
from dsv4.engine.speculative import DSPARK_DRAFT_DIR
from dsv4.model.weights import shard_files

FILES = ("config.json", "dspark_train.json")


def ship_dspark(trained_dir: str, dest: str) -> None:
    tensors = {}
    for file in shard_files(trained_dir):
        tensors.update((k, t) for k, t in load_file(file).items() if k.startswith("mtp."))
    if not tensors:
        raise FileNotFoundError(f"{trained_dir!r} has no mtp.* tensors (not a train_dspark output)")
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    os.makedirs(dest)
    save_file(tensors, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    for name in FILES:
        shutil.copy(os.path.join(trained_dir, name), os.path.join(dest, name))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trained_dir")
    p.add_argument("--dest", default=os.path.join(DEMO_DIR, DSPARK_DRAFT_DIR))
    args = p.parse_args(argv)
    ship_dspark(args.trained_dir, args.dest)
    size = sum(os.path.getsize(os.path.join(args.dest, n)) for n in os.listdir(args.dest))
    print(f"{args.dest}: {sorted(os.listdir(args.dest))}, {size / 2 ** 20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
