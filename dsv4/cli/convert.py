"""`dsv4 convert SRC [OUT]`: rewrite a checkpoint shard by shard (dsv4/model/convert.py):
dequantise to BF16, switch FP8 scales between E8M0 and fp32, rename, split off the MTP/draft
weights. The source is only read; the output is written beside OUT and moved into place."""
from __future__ import annotations

import os
import sys

from tqdm import tqdm

from ..model.checkpoint_reader import CheckpointError
from ..model.convert import ConvertError, ConvertOptions, convert_checkpoint


def register(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert a DeepSeek-V4 checkpoint (BF16, scales, names, MTP draft)")
    p.add_argument("src", help="checkpoint folder to read (never modified)")
    p.add_argument("out", nargs="?", default=None, help="new folder for the converted checkpoint")
    p.add_argument("--to", choices=["bf16"], default=None, help="dequantise FP8 / MXFP4 weights to BF16")
    p.add_argument("--fp8-scales", choices=["e8m0", "fp32"], default=None,
                   help="store FP8 block scales as E8M0 (as released) or fp32 (as Flash-Base); exact, "
                        "refused for values E8M0 cannot hold")
    p.add_argument("--names", choices=["deepseek", "transformers"], default="deepseek",
                   help="tensor names of the output (default: DeepSeek's)")
    p.add_argument("--extract-mtp", metavar="DRAFT", default=None,
                   help="also write the MTP (and DSpark) weights with the shared embed/head as a draft checkpoint")
    p.add_argument("--drop-mtp", action="store_true", help="leave the MTP/draft weights out of OUT")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.out is None and args.extract_mtp is None:
        raise SystemExit("dsv4 convert: give OUT, --extract-mtp DRAFT, or both")
    if args.drop_mtp and args.out is None:
        raise SystemExit("dsv4 convert: --drop-mtp applies to OUT; give OUT")
    if args.to == "bf16" and args.fp8_scales:
        raise SystemExit("dsv4 convert: --fp8-scales: no FP8 scales remain with --to bf16")
    if not os.path.isdir(args.src):
        raise SystemExit(f"dsv4 convert: SRC {args.src!r} is not a folder")
    jobs = []
    if args.out is not None:
        jobs.append((args.out, "main" if args.drop_mtp else "all"))
    if args.extract_mtp is not None:
        jobs.append((args.extract_mtp, "draft"))
    for out, part in jobs:
        opts = ConvertOptions(to=args.to, fp8_scales=args.fp8_scales, names=args.names, part=part)
        try:
            summary = _convert_with_progress(args.src, out, opts, args.quiet)
        except (ConvertError, CheckpointError, ValueError, FileNotFoundError) as e:
            raise SystemExit(f"dsv4 convert: {e}") from None
        shards = f"{summary.shards} shard{'' if summary.shards == 1 else 's'}"
        print(f"wrote {summary.out_dir}: {summary.tensors} tensors in {shards}, "
              f"{_gib(summary.bytes_written)} written ({_gib(summary.bytes_read)} read)"
              f"{f', {summary.dequantised} weights dequantised' if summary.dequantised else ''}"
              f"{f', {summary.rescaled} FP8 scales rewritten' if summary.rescaled else ''}")
    return 0


def _convert_with_progress(src: str, out: str, opts: ConvertOptions, quiet: bool):
    from ..model.checkpoint_reader import shard_files

    total = sum(os.path.getsize(f) for f in shard_files(src))
    with tqdm(total=total, unit="B", unit_scale=True, desc=os.path.basename(os.path.abspath(out)),
              disable=quiet, file=sys.stderr) as bar:
        return convert_checkpoint(src, out, opts, on_shard=lambda _file, size: bar.update(size))


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.2f} MiB"
