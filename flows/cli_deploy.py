"""`enginewright deploy`: register the Prefect deployments (schedules, event triggers, work pools)."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows.deploy import deploy

    print(deploy(args.api_url, prefect_file=Path(args.prefect_file)))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deploy", help="register the Prefect deployments of deployments/prefect.yaml")
    p.add_argument("--api-url", default=None, help="Prefect server API URL (default: PREFECT_API_URL)")
    p.add_argument("--prefect-file", default=str(Path(__file__).resolve().parents[1] / "deployments" / "prefect.yaml"))
    p.set_defaults(func=cmd_deploy)
