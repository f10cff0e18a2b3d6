"""Benchmarks of the torch engine: offline (engine vs HF transformers on the same random weights, HBM
roofline with bandwidth measured in the same run) and served (streaming clients against Triton).

`python3 -m serving.bench offline|served ...` runs them without the rest of the project installed
(the device machine); `enginewright bench ...` is the same command. The perf gate reuses
`serving.bench.offline.bench_engine`.
"""
