"""The lab: benchmarks, sweeps and device scripts of the project, beside the product and never shipped with it
(not in the wheel; `flows`, `tasks`, `serving` and `registry` never import it, tests/test_layering.py).

`python3 -m bench <command> ...` from the repository root runs them (bench/README.md says which command answers
which question). The perf gate's timer is the engine's own, `serving.engine.timing.time_generate`.
"""
