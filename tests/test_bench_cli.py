"""`python3 -m bench`, the lab's command line: it runs from the repository root (the lab is not installed) and
every command's help renders (argparse formats a help string with %, so a bare % breaks `--help`)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench.__main__ import add_arguments

ROOT = Path(__file__).resolve().parents[1]


def test_every_bench_command_renders_its_help():
    parser = argparse.ArgumentParser(prog="python3 -m bench")
    add_arguments(parser)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"offline", "throughput", "served", "gemms"} <= set(commands)
    assert "offline" in parser.format_help()
    for name, command in commands.items():
        assert command.format_help().startswith(f"usage: python3 -m bench {name}"), name


def test_python_m_bench_runs_from_the_repository_root():
    done = subprocess.run([sys.executable, "-m", "bench", "throughput", "--help"], cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--requests" in done.stdout
