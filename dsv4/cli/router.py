"""`dsv4 router`: one OpenAI-compatible API over prefill and decode engines (`dsv4 serve --role`)."""
from __future__ import annotations

import sys

from .args import add_connection_timeouts


def register(subparsers) -> None:
    p = subparsers.add_parser("router", help="prefill/decode router (OpenAI-compatible)",
                              description="Send each request to a prefill engine, then to a decode engine that "
                                          "pulls the prompt's state and streams the tokens.")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill engines (dsv4 serve --role prefill)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode engines (dsv4 serve --role decode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    p.add_argument("--policy", choices=("least-loaded", "round-robin"), default="least-loaded")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S")
    add_connection_timeouts(p)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def run(args) -> int:
    import uvicorn

    from ..router.app import Router, build_router_app
    from ..router.backends import Pool
    from ..serve.http.connection import http_protocol
    from ..serve.http.server import listen_socket
    try:
        router = Router(Pool("prefill", args.prefill, args.policy), Pool("decode", args.decode, args.policy),
                        args.request_timeout)
        sock = listen_socket(args.host, args.port)
    except (ValueError, OSError) as e:
        print(f"dsv4 router: {e}", file=sys.stderr, flush=True)
        return 1
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"dsv4 router: ready at http://{host}:{sock.getsockname()[1]} "
          f"(prefill {' '.join(args.prefill)}; decode {' '.join(args.decode)})", flush=True)
    config = uvicorn.Config(build_router_app(router), log_level=args.log_level,
                            http=http_protocol(args.header_timeout, args.body_timeout))
    uvicorn.Server(config).run(sockets=[sock])
    return 0
