"""`dsv4 serve`: the OpenAI-compatible server (API process + engine-core process)."""
from __future__ import annotations

import os
import signal
import sys

from .args import add_connection_timeouts
from .engine_args import add_engine_args, engine_config

DEMO_NAME = "dsv4-demo"


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve a checkpoint over an OpenAI-compatible HTTP API.")
    p.add_argument("--model", default=None, help="checkpoint folder or random:PRESET[:LAYERS][:k=v,...] (with "
                                                 "--tokenizer; default: the bundled demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use (default: the --model argument, or dsv4-demo)")
    p.add_argument("--api-key", default=os.environ.get("DSV4_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $DSV4_API_KEY)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--api-server-count", type=int, default=None, metavar="N",
                   help="API processes sharing the port, each talking to the one engine core (default: 1; "
                        "more did not help at 256 streams of the demo model on an H200, docs/benchmarks.md)")
    limits = p.add_argument_group("request limits and shutdown")
    limits.add_argument("--max-request-body-mb", type=float, default=32.0, metavar="MB",
                        help="larger request bodies get 413 (default: 32)")
    limits.add_argument("--max-batch-requests", type=int, default=256, metavar="N",
                        help="most generations one request may ask for, prompts x n (default: 256)")
    limits.add_argument("--strict-api", action="store_true",
                        help="reject unknown request fields with 400 (default: ignore them, name them in the "
                             "X-Ignored-Fields header and warn once in the log)")
    limits.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                        help="on SIGTERM/SIGINT, seconds running requests get to finish (default: 30)")
    add_connection_timeouts(limits)
    media = p.add_argument_group("images (vision models, docs/vision.md)")
    media.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="image URLs may name files (file://) inside DIR (default: no local files)")
    media.add_argument("--allow-remote-media", action="store_true",
                       help="image URLs may be http(s):// (fetched by the server; default: data: URLs only)")
    media.add_argument("--media-max-mb", type=float, default=20.0, metavar="MB",
                       help="largest image file accepted (default: 20)")
    media.add_argument("--media-timeout", type=float, default=10.0, metavar="S",
                       help="seconds to fetch one remote image (default: 10)")
    pd = p.add_argument_group("prefill/decode disaggregation (behind `dsv4 router`)")
    pd.add_argument("--role", choices=("prefill", "decode"), default=None,
                    help="serve as a prefill engine (computes prompts, sends their state) or a decode engine "
                         "(pulls the state, streams the tokens); default: colocated")
    pd.add_argument("--kv-transfer", default=None, metavar="JSON",
                    help='with --role: {"host": ..., "port": N (prefill: its state server; 0 = any), '
                         '"timeout": S (decode: per transfer, prefill included; default 30), "transport": "tcp"|"nixl"}')
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..assets import demo_model_dir
    from ..serve.client import EngineStartError
    from ..serve.http.server import APIServer, ServeSettings

    config = engine_config(args, serving=True)
    limits = _limits(args)
    model_dir = args.model or demo_model_dir()
    _check_model_dir(model_dir, config.tokenizer)
    names = args.served_model_name or [args.model or DEMO_NAME]
    disagg = _disagg(args)
    settings = ServeSettings(model_dir=model_dir, model_names=names, engine=config, host=args.host,
                             port=args.port, api_key=args.api_key, log_level=args.log_level, limits=limits,
                             disagg=disagg, api_server_count=api_server_count(args, disagg is not None))
    try:
        server = APIServer(settings)
    except OSError as e:
        return _fail(f"--host/--port: cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    print(f"dsv4 serve: loading {model_dir} ...", flush=True)
    previous = signal.signal(signal.SIGTERM, _interrupt)   # while loading, SIGTERM stops us as Ctrl-C does
    try:
        info = server.start_engine()
    except EngineStartError as e:
        return _fail(f"the engine could not start: {e}")
    except KeyboardInterrupt:
        return _fail("interrupted while loading the model", code=130)
    finally:
        signal.signal(signal.SIGTERM, previous)

    print(info.memory_report, flush=True)       # the memory plan, as `dsv4 plan` reports it

    def ready() -> None:
        pids = server.pids
        print(f"dsv4 serve: processes: api {' '.join(map(str, pids['api']))}; engine core {pids['engine'][0]}",
              flush=True)
        print(f"dsv4 serve: ready at {server.url} (model {', '.join(names)}, max_model_len "
              f"{info.max_model_len}, {settings.api_server_count} API process"
              f"{'es' if settings.api_server_count > 1 else ''})", flush=True)

    return server.serve(on_ready=ready)


def _limits(args):
    from ..serve.http.limits import MB, ServerLimits
    if not args.max_request_body_mb > 0:
        raise SystemExit(f"dsv4 serve: --max-request-body-mb must be > 0, got {args.max_request_body_mb}")
    if args.max_batch_requests < 1:
        raise SystemExit(f"dsv4 serve: --max-batch-requests must be >= 1, got {args.max_batch_requests}")
    if not args.shutdown_timeout >= 0:
        raise SystemExit(f"dsv4 serve: --shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    from ..serve.http.media import MediaPolicy
    if not args.media_max_mb > 0 or not args.media_timeout > 0:
        raise SystemExit("dsv4 serve: --media-max-mb and --media-timeout must be > 0")
    if args.allowed_local_media_path is not None and not os.path.isdir(args.allowed_local_media_path):
        raise SystemExit(f"dsv4 serve: --allowed-local-media-path {args.allowed_local_media_path!r} is not a folder")
    media = MediaPolicy(args.allowed_local_media_path, args.allow_remote_media, int(args.media_max_mb * MB),
                        args.media_timeout)
    return ServerLimits(max_body_bytes=int(args.max_request_body_mb * MB), max_batch_requests=args.max_batch_requests,
                        strict_api=args.strict_api, shutdown_timeout=args.shutdown_timeout,
                        header_timeout=args.header_timeout, body_timeout=args.body_timeout, media=media)


def api_server_count(args, disaggregated: bool) -> int:
    cores = len(os.sched_getaffinity(0))
    n = args.api_server_count
    if n is None:
        return 1
    if n < 1:
        raise SystemExit(f"dsv4 serve: --api-server-count must be >= 1, got {n}")
    if n > cores:
        raise SystemExit(f"dsv4 serve: --api-server-count {n} is more than the {cores} cores this process may use")
    if disaggregated and n > 1:
        raise SystemExit("dsv4 serve: --api-server-count: a prefill/decode role (--role) runs one API process")
    return n


def _disagg(args):
    if args.role is None:
        if args.kv_transfer is not None:
            raise SystemExit("dsv4 serve: --kv-transfer needs --role prefill|decode")
        return None
    if getattr(args, "data_parallel_size", 1) > 1:
        raise SystemExit("dsv4 serve: --role: a prefill/decode engine sends one rank's cache; "
                         "--data-parallel-size spreads requests over several: use it without --role")
    from ..disagg.settings import parse_kv_transfer
    try:
        return parse_kv_transfer(args.role, args.kv_transfer)
    except ValueError as e:
        raise SystemExit(f"dsv4 serve: {e}") from None


def _check_model_dir(model_dir: str, tokenizer: str | None) -> None:
    from ..model.random_model import is_random_spec
    if tokenizer is not None and not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
        raise SystemExit(f"dsv4 serve: --tokenizer {tokenizer}: no tokenizer.json there")
    if is_random_spec(model_dir):
        if tokenizer is None:
            raise SystemExit(f"dsv4 serve: --model {model_dir}: a random model has no tokenizer; give --tokenizer DIR")
        return
    if not os.path.isdir(model_dir):
        raise SystemExit(f"dsv4 serve: --model {model_dir}: no such directory")
    if tokenizer is None and not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        raise SystemExit(f"dsv4 serve: --model {model_dir}: no tokenizer.json (the server needs the "
                         f"checkpoint's tokenizer; or give --tokenizer DIR)")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _fail(message: str, code: int = 1) -> int:
    print(f"dsv4 serve: {message}", file=sys.stderr, flush=True)
    return code
