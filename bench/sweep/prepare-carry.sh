#!/usr/bin/env bash
# Fill build/device-carry/ (git-ignored) with what bench/sweep/device-setup.sh installs on the lent
# GPU machine, which has no network: the Python packages of the router, the workers' etcd/NATS
# clients and the load generator that its image lacks (cp312 wheels, no dependencies pulled),
# and Debian's etcd and nats-server binaries, xz-compressed (21 + 11 MB -> 9 MB). Run from the
# repository root; pass `carry: [".whl", "build/device-carry"]` to the device run.
set -euo pipefail
out=build/device-carry
mkdir -p "$out/whl"
.venv/bin/python -P -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$out/whl" \
  aetcd==1.0.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 nats-py==2.16.0 \
  openai==3.57.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
  opentelemetry-api==1.45.2 jiter==0.19.0 typing_extensions==4.16.0 annotated-doc==0.0.7 \
  anyio==4.16.0 h11==0.16.0 idna==3.20
xz -T2 -6 -c "$(command -v etcd || echo /usr/bin/etcd)" > "$out/etcd.xz"
xz -T2 -6 -c "$(command -v nats-server || echo /usr/sbin/nats-server)" > "$out/nats-server.xz"
du -sh "$out"
