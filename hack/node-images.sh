#!/usr/bin/env bash
# The platform images of the real-node tests, none of which can be pulled here: the pod sandbox
# (pause), CoreDNS, Traefik, and etcd and NATS for the chart's bundled servers. Each is `FROM
# scratch` plus static binaries from hack/k8s-binaries.sh, tagged <version>-<sha of its files>.
# Prints one `name=reference` line per image.
#
#   hack/node-images.sh                 # build what is missing
#   hack/node-images.sh import SOCKET   # and load them into the containerd at SOCKET
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/buildah.sh
. hack/buildah.sh
K8S_VERSION=${K8S_VERSION:-v1.36.3}
BIN=${K8S_HARNESS_CACHE:-$HOME/.cache/kvrail/k8s}/$K8S_VERSION/bin
log() { echo "node-images: $*" >&2; }

# image NAME VERSION USER ENTRYPOINT-JSON FILE... : FILE is a path, copied to /usr/local/bin.
image() {
  local name=$1 version=$2 user=$3 entrypoint=$4 ref c f
  shift 4
  for f in "$@"; do [ -f "$f" ] || { log "missing $f: run hack/k8s-binaries.sh"; exit 1; }; done
  ref=localhost/kvrail-test/$name:$version-$(cat "$@" <(echo "$user $entrypoint") | sha256sum | cut -c1-8)
  if ! bah inspect --type image "$ref" >/dev/null 2>&1; then
    c=$(bah from scratch)
    for f in "$@"; do bah copy --chmod 0755 "$c" "$f" "/usr/local/bin/$(basename "$f")" >/dev/null; done
    bah config --env PATH=/usr/local/bin --user "$user" --entrypoint "$entrypoint" "$c"
    bah commit -q --rm "$c" "$ref" >/dev/null
    log "built $ref"
  fi
  echo "$name=$ref"
}

build_all() {
  local out
  out=$(mktemp -d)
  trap 'rm -rf "$out"' RETURN
  gcc -static -O2 -o "$out/pause" hack/node/pause.c
  image pause 3.10.1 65535 '["/usr/local/bin/pause"]' "$out/pause"
  image coredns "$("$BIN/coredns" -version | sed -n 's/^CoreDNS-//p')" 65532 \
    '["/usr/local/bin/coredns"]' "$BIN/coredns"
  image traefik "$("$BIN/traefik" version | awk '/^Version:/ {print $2}')" 65532 \
    '["/usr/local/bin/traefik"]' "$BIN/traefik"
  image etcd "v$("$BIN/etcd" --version | awk '/^etcd Version:/ {print $3}')" 65532 \
    '["/usr/local/bin/etcd"]' "$BIN/etcd" "$BIN/etcdctl"
  image nats "$("$BIN/nats-server" --version | awk '{print $2}')" 65532 \
    '["/usr/local/bin/nats-server"]' "$BIN/nats-server"
}

case "${1:-build}" in
  build) build_all ;;
  import)
    [ $# -eq 2 ] || { echo "usage: $0 import SOCKET" >&2; exit 2; }
    build_all | while IFS== read -r name ref; do ctr_import "$ref" "$2"; echo "$name=$ref"; done ;;
  *) echo "usage: $0 [build|import SOCKET]" >&2; exit 2 ;;
esac
