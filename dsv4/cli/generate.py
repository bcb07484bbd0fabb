"""`dsv4 generate`: offline generation from the command line."""
from __future__ import annotations

import sys

from .engine_args import add_engine_args, engine_config


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text or tokens offline")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled demo model)")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], help="a prompt as comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--show-memory", action="store_true", help="print the KV cache report first")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..engine.llm import LLM
    from ..sampling_params import SamplingParams

    if not args.prompt and not args.prompt_ids:
        raise SystemExit("dsv4 generate: give --prompt TEXT or --prompt-ids 1,2,3")
    try:
        id_prompts = [[int(t) for t in s.split(",") if t.strip()] for s in args.prompt_ids]
    except ValueError:
        raise SystemExit("--prompt-ids: expected comma-separated integers") from None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    from ..config import ConfigError
    try:
        llm = LLM(args.model, **vars(engine_config(args)))
    except ConfigError as e:             # a setting the model cannot serve (e.g. MTP without an MTP block)
        raise SystemExit(f"--{e.field.replace('_', '-')}: {e}") from None
    if args.show_memory:
        print(llm.engine.memory_report())
    try:
        outs = []
        if args.prompt:
            outs += llm.generate(args.prompt, params, use_tqdm=False)
        if id_prompts:
            outs += llm.generate(prompt_token_ids=id_prompts, sampling_params=params, use_tqdm=False)
    except ValueError as e:
        print(f"dsv4 generate: {e}", file=sys.stderr)
        return 2
    for out in outs:
        print(f"[{out.finish_reason}] token ids: {' '.join(map(str, out.token_ids))}")
        if out.text is not None:
            print(out.text)
    return 0
