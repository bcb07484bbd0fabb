

def parse_smoke_args(doc: str, smoke_help: str, add=None):
    """A kernel benchmark's flags: --smoke (CPU, Triton's interpreter; help `smoke_help`) and
    those `add(parser)` adds -> (args, device: "cpu" with --smoke, else "cuda"); exits when
    there is no CUDA device and no --smoke."""
    import argparse
    import sys

    import torch
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    if add is not None:
        add(p)
    args = p.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs CUDA (or --smoke)")
    return args, device
