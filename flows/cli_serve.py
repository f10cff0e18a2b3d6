"""`enginewright serve`: the OpenAI-compatible HTTP front over the Triton router models."""

from __future__ import annotations

import argparse

from serving.openai.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PROMPT_CHARS


def cmd_serve(args: argparse.Namespace) -> int:
    from serving.openai.limits import FrontLimits
    from serving.openai.server import run_server

    try:
        limits = FrontLimits(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars)
    except ValueError as exc:
        raise SystemExit(f"enginewright serve: {exc}") from None
    run_server(grpc_url=args.triton_grpc, models=args.model, host=args.host, port=args.port,
               timeout_s=args.timeout_s, limits=limits)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible API (/v1/completions, /v1/chat/completions) over Triton")
    p.add_argument("--triton-grpc", required=True, help="Triton gRPC address, e.g. 127.0.0.1:8001")
    p.add_argument("--model", action="append", required=True, help="a router model to serve (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--timeout-s", type=float, default=60.0, help="deadline of one request to Triton")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted (413 beyond)")
    p.add_argument("--max-prompt-chars", type=int, default=DEFAULT_MAX_PROMPT_CHARS,
                   help="longest prompt accepted, in characters, before it reaches Triton (400 beyond)")
    p.set_defaults(func=cmd_serve)
