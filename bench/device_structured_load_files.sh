#!/usr/bin/env bash
# Here, not on the device: what bench/device_structured_load.sh needs beside .whl/ (bench/device_wheels.sh), into
# .dev/structload/ (ignored through .git/info/exclude's /.dev/; carry it: `run(..., carry=[".whl", ".dev/structload"])`,
# 1.3 + 4.2 MB beside .whl's 50, under the 64 MiB limit):
#  - tokenizer.json.xz: the byte-level BPE of Llama-3's vocabulary (128,256) trained on this machine's Python
#    standard library, <|begin_of_text|> and <|end_of_text|> at 128000 and 128001 as the 8B shape's ids say
#    (bench/vocab_tokenizer.py; took 1.5 min on 2 loaded cores), so the device spends no time training it;
#  - wheels/: the OpenAI front (fastapi, starlette, uvicorn, prometheus_client and their dependencies), the grammar
#    engine (llguidance) and the clients' httpx, for CPython 3.12, at the versions this project's .venv tests.
# Env (default): VOCAB=128256, FIRST_SPECIAL=128000, PYTHON=.venv/bin/python. Prints the folder's size.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.dev/structload
PYTHON=${PYTHON:-.venv/bin/python}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$DEST/wheels"
if [ ! -s "$DEST/tokenizer.json.xz" ]; then
  "$PYTHON" bench/vocab_tokenizer.py --vocab "${VOCAB:-128256}" --first-special "${FIRST_SPECIAL:-128000}" --out "$TMP/tok"
  xz -9 -c "$TMP/tok/tokenizer.json" >"$DEST/tokenizer.json.xz"
fi
# the same versions as .venv (what the tests here ran), pure Python except llguidance (abi3, manylinux_2_31)
pins=$("$PYTHON" - <<'PY'
import importlib.metadata as m
names = ["fastapi", "starlette", "uvicorn", "click", "h11", "prometheus_client", "llguidance", "anyio", "idna",
         "httpx", "httpcore", "certifi", "annotated-doc", "opentelemetry-api"]
print(" ".join(f"{n}=={m.version(n)}" for n in names))
PY
)
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 -d "$DEST/wheels" $pins
du -sh "$DEST"
