"""`enginewright rollback MODEL [--to VERSION]` and `enginewright rollout-status MODEL`."""

from __future__ import annotations

import argparse
from pathlib import Path


def _spec(args: argparse.Namespace):
    from flows.spec import SpecError, load_spec

    spec = load_spec(Path(args.spec))
    if spec.model_name != args.model:
        raise SpecError(f"model {args.model!r} (argument MODEL) is not the model of spec {args.spec} "
                        f"({spec.model_name!r})")
    return spec


def cmd_rollback(args: argparse.Namespace) -> int:
    from flows.cli import EXIT_GATE
    from flows.rollback import rollback_flow
    from flows.run import outcome_of

    spec = _spec(args)
    outcome = outcome_of(rollback_flow(spec, args.to, args.immediate, return_state=True), what="rollback")
    print(outcome.summary())
    return 0 if outcome.ok else EXIT_GATE


def cmd_rollout_status(args: argparse.Namespace) -> int:
    """Print the journal and router weights; first reconcile a rollout whose run is gone (one whose run cannot be
    seen from here with --reconcile), saying what was done. A rollout whose run still works is only shown."""
    from flows.promote import recover_unfinished
    from serving.triton.repository import router_weights
    from tasks.rollout_state import owner_running, read_journal
    from tasks.targets import resolve_targets

    spec = _spec(args)
    repos = [t.model_repository for t in resolve_targets(spec.triton, embedded_url="http://embedded")]
    journal = read_journal(repos, spec.model_name)
    if journal is not None and not journal.terminal:
        running = owner_running(journal)
        if running:
            print(f"{spec.model_name}: the {journal.kind} of version {journal.candidate} is in progress (its run, "
                  f"{journal.owner}, still works): not reconciled")
        elif running is None and not args.reconcile:
            print(f"{spec.model_name}: the {journal.kind} of version {journal.candidate} is unfinished and its run "
                  f"({journal.owner or 'not recorded'}) cannot be looked at from here: pass --reconcile once it is "
                  "surely gone")
        else:
            recovered = recover_unfinished(spec)
            print(recovered.line if recovered is not None else f"{spec.model_name}: nothing to reconcile")
            journal = read_journal(repos, spec.model_name)
    for repo in repos:
        print(f"{repo}: router weights {router_weights(repo, spec.model_name) or '(no router)'}")
    if journal is None:
        print(f"{spec.model_name}: no rollout recorded")
    else:
        print(f"{spec.model_name}: {journal.kind} of version {journal.candidate} over {journal.live}: phase "
              f"{journal.phase} (step {journal.step}, weights {journal.weights}){' ' + journal.reason if journal.reason else ''}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `rollback` and `rollout-status`."""
    p = subparsers.add_parser("rollback", help="return a model to an earlier published version through the router")
    p.add_argument("model", help="registered model name (the spec's)")
    p.add_argument("--spec", required=True, help="release spec YAML (Triton endpoints, MLflow, artifacts)")
    p.add_argument("--to", default=None, help="MLflow version to return to (default: the previous production one)")
    p.add_argument("--immediate", action="store_true", help="switch at once instead of the spec's gray steps")
    p.set_defaults(func=cmd_rollback)
    p = subparsers.add_parser("rollout-status", help="the rollout journal and router weights of a model; a rollout "
                              "whose run was killed is reconciled first")
    p.add_argument("model")
    p.add_argument("--spec", required=True)
    p.add_argument("--reconcile", action="store_true",
                   help="reconcile an unfinished rollout whose run cannot be seen from here (it ran on another host "
                   "or before runs were recorded); one whose run is gone is reconciled without it")
    p.set_defaults(func=cmd_rollout_status)
