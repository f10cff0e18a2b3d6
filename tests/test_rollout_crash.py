"""Crash safety: a real process of its own runs the promotion and is SIGKILLed at checkpoint k, for EVERY k; a
re-run then reconciles, and Triton (router weights, served/loaded versions, folders), the journal and
MLflow's aliases must describe one consistent state: the old version (rolled back) or the new one
(finished), never a mix.

Checkpoints are the points where a crash leaves a distinct state (each journal write, each staged folder,
each reload); a clean run lists them in ``$ENGINEWRIGHT_TEST_CHECKPOINT_LOG`` and the crashing run kills
itself with SIGKILL at the k-th (``$ENGINEWRIGHT_TEST_CRASH_AT``), the same signal an OOM killer or
``kill -9`` sends.

A promotion killed from outside mid-rollout (at 50/50, the state an outer timeout left a demo in) is then
reconciled by each of the three commands that may come next: `promote`, `rollback`, `rollout-status`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_rollout_support import assert_consistent, first_release, make_spec, publish, start_server
from triton_support import TritonServers, make_tiny_engine

from flows.promote import RolloutInterrupted, promote
from tasks.rollout_state import CHECKPOINT_LOG_ENV, CRASH_ENV

pytestmark = pytest.mark.slow
NAME = "crashy"
STEPS = [{"set_weight": 50}, {"analysis": {"requests": 4, "metrics": [], "compare": None}}, {"set_weight": 100}]
STUCK_STEPS = [{"set_weight": 50}, {"analysis": {"requests": 100000, "metrics": [], "compare": None, "text_pairs": 0,
                                                 "timeout_s": 300}}, {"set_weight": 100}]
# A promotion in a process of its own, forked from a helper that imported everything once (importing torch,
# Prefect and MLflow takes seconds per process). Per line on stdin (spec file, version, log file, env):
# fork, run promote() in the child (stdout and stderr to the log), answer the child's pid, then its exit
# code (-9: it SIGKILLed itself at the checkpoint). The helper only imports: no connection or thread is forked.
FORKER = """\
import json, os, sys, traceback
import flows.promote, flows.spec, registry.model_registry, registry.promotion_checks, tasks.approve
import mlflow.store.model_registry.sqlalchemy_store, mlflow.store.tracking.sqlalchemy_store  # promote's first MLflow call
while line := sys.stdin.readline():
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(job["env"])
        code = 0
        try:
            with open(job["spec"]) as f:
                flows.promote.promote(flows.spec.parse_spec(json.load(f)), job["version"])
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    print(json.dumps({"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
os._exit(0)  # stdin closed: nothing left to flush, and tearing down torch and MLflow takes a second
"""


class Forker:
    """The helper process above; ``run`` returns the promotion's exit code and output."""

    def __init__(self, cwd: Path) -> None:
        # unbuffered: readline() then takes no more than one line, so select() sees the next one
        self.proc = subprocess.Popen([sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     bufsize=0, cwd=cwd)

    def _answer(self, timeout_s: float) -> dict:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            raise TimeoutError(f"no answer from the promotion within {timeout_s:g} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the forking helper exited with {self.proc.wait()}")
        return json.loads(line)

    def run(self, spec_file: Path, version: str, log: Path, **env: str) -> tuple[int, str]:
        pid = self.start(spec_file, version, log, **env)
        return self.exit_code(pid), log.read_text()

    def start(self, spec_file: Path, version: str, log: Path, **env: str) -> int:
        """Start a promotion; its pid (answer ``exit_code`` before the next ``start``)."""
        assert self.proc.stdin is not None
        job = {"spec": str(spec_file), "version": version, "log": str(log), "env": env}
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        return self._answer(60)["pid"]

    def exit_code(self, pid: int) -> int:
        try:
            return self._answer(300)["code"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            raise

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("crash")
    for seed in (0, 1):
        publish(tmp, NAME, make_tiny_engine(tmp / "engines", seed=seed))
    servers = TritonServers(tmp)
    forker = None
    try:
        proc = start_server(servers, tmp / "repo")
        spec = make_spec(tmp, NAME, [proc], steps=STEPS, warmup_requests=1)
        spec_file = tmp / "spec.json"
        spec_file.write_text(spec.model_dump_json())
        forker = Forker(Path(__file__).resolve().parents[1])
        # the same rollout but for an analysis that wants far more requests than come before a kill: it sits at
        # 50/50 until killed from outside
        stuck = make_spec(tmp, NAME, [proc], steps=STUCK_STEPS, warmup_requests=1)
        stuck_file = tmp / "stuck.json"
        stuck_file.write_text(stuck.model_dump_json())
        yield {"tmp": tmp, "spec": spec, "spec_file": spec_file, "forker": forker, "stuck_file": stuck_file,
               "repo": proc.model_repository}
    finally:
        if forker is not None:
            forker.stop()
        servers.stop_all()


def run_promote(world, version: str, run: str, **env: str) -> tuple[int, str]:
    return world["forker"].run(world["spec_file"], version, world["tmp"] / f"promote-{run}.log", **env)


def test_kill_at_every_checkpoint_then_rerun_is_consistent(world) -> None:
    spec, tmp = world["spec"], world["tmp"]
    first_release(spec)
    live = 1
    log = tmp / "checkpoints.txt"
    code, output = run_promote(world, "2", "clean", **{CHECKPOINT_LOG_ENV: str(log)})
    assert code == 0, output[-3000:]
    labels = log.read_text().splitlines()
    live = 2
    assert_consistent(spec, live)
    print(f"\n{len(labels)} checkpoints in a promotion:\n" + "\n".join(labels))
    assert len(labels) >= 8

    outcomes = []
    for k in range(1, len(labels) + 1):
        candidate = 1 if live == 2 else 2
        t0 = time.monotonic()
        code, output = run_promote(world, str(candidate), f"crash-{k}", **{CRASH_ENV: str(k)})
        assert code == -signal.SIGKILL, (k, code, output[-3000:])
        try:
            promote(spec, str(candidate))  # the re-run: reconcile (finish), or ...
            live = candidate
            what = "finished"
        except RolloutInterrupted:  # ... reconcile (roll back) and stop
            what = "rolled back"
        state = assert_consistent(spec, live)
        outcomes.append(f"k={k} ({labels[k - 1].split(' ', 1)[1]}): {what}, live v{live}, journal "
                        f"{state['journal'][0]} ({time.monotonic() - t0:.1f} s)")
        print(outcomes[-1])
    (tmp / "outcomes.json").write_text(json.dumps(outcomes, indent=1))
    assert any("finished" in o for o in outcomes) and any("rolled back" in o for o in outcomes)


def kill_mid_rollout(world, candidate: int, live: int, run: str) -> None:
    """Promote ``candidate`` in a process of its own and SIGKILL it from outside once the router splits 50/50
    (as an outer timeout killed a demo mid-rollout)."""
    from serving.triton.repository import router_weights
    from tasks.rollout_state import read_journal

    log = world["tmp"] / f"stuck-{run}.log"
    pid = world["forker"].start(world["stuck_file"], str(candidate), log)
    deadline = time.monotonic() + 240
    try:
        while router_weights(world["repo"], NAME) != {live: 50, candidate: 50}:
            assert time.monotonic() < deadline, f"no 50/50 split within 240 s: {log.read_text()[-3000:]}"
            time.sleep(0.1)
    finally:
        os.kill(pid, signal.SIGKILL)
        assert world["forker"].exit_code(pid) == -signal.SIGKILL, log.read_text()[-3000:]
    journal = read_journal([world["repo"]], NAME)
    assert journal is not None and journal.phase == "shifting", journal


def test_each_command_after_a_promotion_killed_from_outside_leaves_one_version_serving(world, capsys) -> None:
    """`promote`, `rollback` and `rollout-status` each bring a promotion SIGKILLed at 50/50 back to one version
    serving 100% on every endpoint, with MLflow's production alias naming it."""
    from flows.cli import main
    from flows.rollback import rollback
    from registry import model_registry as mr

    spec = world["spec"]
    live = int(mr.get_version_by_alias(spec.mlflow.tracking_uri, NAME, mr.ALIAS_PRODUCTION))
    candidate = 1 if live == 2 else 2
    assert_consistent(spec, live)

    kill_mid_rollout(world, candidate, live, "promote")
    with pytest.raises(RolloutInterrupted, match=f"rolled back to version {live}"):
        promote(spec, str(candidate))
    assert_consistent(spec, live)
    assert mr.get_version_tags(spec.mlflow.tracking_uri, NAME, str(candidate))["rollout"] == "interrupted"

    kill_mid_rollout(world, candidate, live, "rollback")
    capsys.readouterr()
    assert rollback(spec).version == str(live)  # the interrupted promotion rolled back: nothing more moves
    said = capsys.readouterr().out
    assert f"reconciled the unfinished promote of {NAME} version {candidate}" in said, said
    assert_consistent(spec, live)

    kill_mid_rollout(world, candidate, live, "rollout-status")
    capsys.readouterr()
    assert main(["rollout-status", NAME, "--spec", str(world["spec_file"])]) == 0
    said = capsys.readouterr().out
    assert (f"rolled it back; version {live} serves 100% of traffic on every endpoint and is MLflow's production"
            in said and "phase interrupted" in said), said
    assert_consistent(spec, live)


def test_rollout_status_only_shows_a_rollout_whose_run_still_works(world, capsys) -> None:
    """A journal whose writer still runs (here: this very process) is a rollout in progress: shown, not touched."""
    from flows.cli import main
    from serving.triton.repository import router_weights
    from tasks.rollout_state import Journal, read_journal, write_journal

    before = read_journal([world["repo"]], NAME)
    weights = router_weights(world["repo"], NAME)
    write_journal([world["repo"]], Journal(NAME, 9, 1, "shifting", step=0, weights={1: 50, 9: 50}, seq=before.seq))
    try:
        assert main(["rollout-status", NAME, "--spec", str(world["spec_file"])]) == 0
        said = capsys.readouterr().out
        assert "is in progress" in said and "not reconciled" in said, said
        assert router_weights(world["repo"], NAME) == weights
    finally:
        write_journal([world["repo"]], before)
