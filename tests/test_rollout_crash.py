"""Crash safety: a real subprocess runs the promotion and is SIGKILLed at checkpoint k, for EVERY k; a
re-run then reconciles, and Triton (router weights, served/loaded versions, folders), the journal and
MLflow's aliases must describe one consistent state: the old version (rolled back) or the new one
(finished), never a mix.

Checkpoints are the points where a crash leaves a distinct state (each journal write, each staged folder,
each reload); a clean run lists them in ``$ENGINEWRIGHT_TEST_CHECKPOINT_LOG`` and the crashing run kills
itself with SIGKILL at the k-th (``$ENGINEWRIGHT_TEST_CRASH_AT``), the same signal an OOM killer or
``kill -9`` sends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_rollout_support import assert_consistent, make_spec, publish
from triton_support import TritonServers, make_tiny_engine

from flows.promote import RolloutInterrupted, promote
from serving.triton.repository import init_repository
from tasks.rollout_state import CHECKPOINT_LOG_ENV, CRASH_ENV

pytestmark = pytest.mark.slow
NAME = "crashy"
STEPS = [{"set_weight": 50}, {"analysis": {"requests": 4, "metrics": [], "compare": None}}, {"set_weight": 100}]
SCRIPT = ("import json, sys\nfrom flows.spec import parse_spec\nfrom flows.promote import promote\n"
          "promote(parse_spec(json.loads(open(sys.argv[1]).read())), sys.argv[2])\n")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("crash")
    for seed in (0, 1):
        publish(tmp, NAME, make_tiny_engine(tmp / "engines", seed=seed))
    servers = TritonServers(tmp)
    proc = servers.start(init_repository(tmp / "repo"))
    spec = make_spec(tmp, NAME, [proc], steps=STEPS, warmup_requests=1)
    spec_file = tmp / "spec.json"
    spec_file.write_text(spec.model_dump_json())
    yield {"tmp": tmp, "spec": spec, "spec_file": spec_file}
    servers.stop_all()


def run_promote(world, version: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(world["spec_file"]), version],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=300, check=False)


def test_kill_at_every_checkpoint_then_rerun_is_consistent(world) -> None:
    spec, tmp = world["spec"], world["tmp"]
    promote(spec, "1")
    live = 1
    log = tmp / "checkpoints.txt"
    clean = run_promote(world, "2", **{CHECKPOINT_LOG_ENV: str(log)})
    assert clean.returncode == 0, clean.stderr[-3000:]
    labels = log.read_text().splitlines()
    live = 2
    assert_consistent(spec, live)
    print(f"\n{len(labels)} checkpoints in a promotion:\n" + "\n".join(labels))
    assert len(labels) >= 8

    outcomes = []
    for k in range(1, len(labels) + 1):
        candidate = 1 if live == 2 else 2
        t0 = time.monotonic()
        crashed = run_promote(world, str(candidate), **{CRASH_ENV: str(k)})
        assert crashed.returncode == -signal.SIGKILL, (k, crashed.returncode, crashed.stderr[-3000:])
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
