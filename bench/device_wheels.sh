#!/usr/bin/env bash
# The wheels that bench/device_served.sh needs on the device (which has no internet), assembled
# here from PyPI into .whl/ (git-ignored; carry it: `run(..., carry=[".whl"])`, under the 64 MiB limit):
#  - numpy 1.26.4 and python-rapidjson 1.20 for CPython 3.12 (the Triton stub's venv),
#  - pytriton-312.tar.xz: the nvidia-pytriton 0.7.0 wheel's pytriton/, nvidia_pytriton.libs/ and dist-info
#    without the other Pythons' backend stubs and libpython3.13 (27 MB instead of 55),
#  - site/tritonclient: tritonclient 2.51.0 unpacked (its Python package only),
#  - pyd/: pydantic and its dependencies (tasks.validate, for the parity test).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$DEST/pyd" "$DEST/site"
unzip_with_modes() {  # python's zipfile drops the executable bits (tritonserver, the backend stub)
  python3 - "$1" "$2" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as archive:
    for info in archive.infolist():
        path = archive.extract(info, sys.argv[2])
        mode = info.external_attr >> 16 & 0o777
        if mode and not info.is_dir():
            os.chmod(path, mode)
PY
}
wheels() {  # CPython 3.12 manylinux wheels, no dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_35_x86_64 -d "$@"
}
wheels "$DEST" numpy==1.26.4 python-rapidjson==1.20
wheels "$TMP" nvidia-pytriton==0.7.0 tritonclient==2.51.0
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$DEST/pyd" "pydantic>=2.7"

mkdir "$TMP/pt" "$TMP/tc"
unzip_with_modes "$TMP"/nvidia_pytriton-0.7.0-*.whl "$TMP/pt"
find "$TMP/pt/pytriton/tritonserver/python_backend_stubs" -mindepth 1 -maxdepth 1 ! -name 3.12 -exec rm -rf {} +
rm -f "$TMP"/pt/nvidia_pytriton.libs/libpython3-*.13.so*
test -x "$TMP/pt/pytriton/tritonserver/bin/tritonserver"
tar -cJf "$DEST/pytriton-312.tar.xz" -C "$TMP/pt" .
unzip_with_modes "$TMP"/tritonclient-2.51.0-*.whl "$TMP/tc"
rm -rf "$DEST/site/tritonclient"
cp -r "$TMP"/tc/tritonclient-2.51.0.data/purelib/tritonclient "$DEST/site/"
du -sh "$DEST"
