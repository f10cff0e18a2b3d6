#!/usr/bin/env bash
# /tmp/venv on the device, for the Triton stub (it finds packages through the first python3 on PATH) and the
# streaming clients: the image's packages, with numpy 1.26 shadowing its numpy 2 (the bundled python backend
# sends empty tensors with numpy 2), the bundled Triton (pytriton) and tritonclient, from the wheels in .whl/
# (bench/device_wheels.sh). Run from the repo root; exits non-zero when the venv cannot import them.
set -e
python3 -m venv --without-pip --system-site-packages /tmp/venv
SP=$(/tmp/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SP" \
  .whl/numpy-1.26.4-*.whl .whl/python_rapidjson-*.whl
# the image's packages are not all in the base interpreter's site-packages: list every sys.path folder
# of the system python3 in a .pth (processed after the venv's own folder, so numpy 1.26 still wins)
python3 -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
  >"$SP/zz-system-packages.pth"
tar -xJf .whl/pytriton-312.tar.xz -C "$SP"
cp -r .whl/site/tritonclient "$SP"/
/tmp/venv/bin/python -c 'import importlib.util, numpy, torch, tritonclient.grpc; assert importlib.util.find_spec("pytriton"); print("venv: numpy", numpy.__version__, "torch", torch.__version__, torch.from_numpy(numpy.ones(2)).sum().item())'
