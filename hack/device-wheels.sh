#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what the lent GPU machine lacks to run kvrail's GPU tests and
# benchmarks: its image has torch, triton, transformers, numpy, httpx, pyyaml, grpcio, protobuf,
# prometheus-client and uvloop, but not pydantic (every kvrail.settings import needs it), NIXL,
# the clients and servers of the full stack (aetcd, NATS, FastAPI, uvicorn, openai), pytest
# (the GPU tests), py-spy (the profiles), the cuDNN frontend (FP8 attention: its graph API over
# the cuDNN that torch ships), llguidance (grammars: structured outputs, forced tool calls) or
# jsonschema (the grammar tests validate what they generate).
# CPython 3.12, manylinux x86_64 wheels, no dependencies pulled: the list is complete on purpose.
# Run from the repository root; name `.whl` in the device run's `carry`, then
# `source hack/device-env.sh`.
#
#   hack/device-wheels.sh            # about 45 MB; a rerun downloads nothing new
set -euo pipefail
dest=.whl
mkdir -p "$dest"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
plat=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
# Pinned to the versions the CPU venv runs (`make setup`), so both machines run the same code.
wheels=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  nixl==1.5.1 nixl-cu13==1.5.1
  aetcd==1.0.0 nats-py==2.16.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
  annotated-doc==0.0.7 anyio==4.16.0 h11==0.16.0 idna==3.20 sniffio==1.3.1 httptools==0.9.0
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 truststore==0.10.5
  opentelemetry-api==1.45.2 distro==1.9.0
  py-spy==0.4.3 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4
  nvidia-cudnn-frontend==1.18.0
  llguidance==1.9.1
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  attrs==26.1.0
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d "$dest" "${wheels[@]}"
# nixl-cu13 carries expert-parallel extensions for several torch versions that KV transfer never
# loads; without them the wheel is about half its size.
for w in "$dest"/nixl_cu13-*.whl; do
  python3 - "$w" <<'PY'
import os, sys, zipfile
src = sys.argv[1]
with zipfile.ZipFile(src) as zi:
    names = zi.namelist()
    drop = [n for n in names if n.startswith(("nixl_ep_cu13/", "nixl_ep/")) or "perftest" in n]
    if not drop:
        sys.exit(0)
    tmp = src + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
        for item in zi.infolist():
            if item.filename not in drop:
                zo.writestr(item, zi.read(item.filename))
os.replace(tmp, src)
PY
done
du -ch "$dest"/*.whl | tail -n 1
