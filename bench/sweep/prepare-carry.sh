#!/usr/bin/env bash
# Fill build/device-carry/ (git-ignored) with what a full-stack run on the lent GPU machine needs
# besides the wheels of hack/device-wheels.sh: Debian's etcd and nats-server binaries,
# xz-compressed (21 + 11 MB -> 9 MB). Run from the repository root; pass
# `carry: [".whl", "build/device-carry"]` to the device run.
set -euo pipefail
out=build/device-carry
mkdir -p "$out"
xz -T2 -6 -c "$(command -v etcd || echo /usr/bin/etcd)" > "$out/etcd.xz"
xz -T2 -6 -c "$(command -v nats-server || echo /usr/sbin/nats-server)" > "$out/nats-server.xz"
du -sh "$out"
