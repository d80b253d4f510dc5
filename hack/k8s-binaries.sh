#!/usr/bin/env bash
# Build the Kubernetes test binaries from the Go module proxy, idempotently, into a cache outside
# the repository: kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kube-proxy
# (k8s.io/kubernetes), etcd for the API server, kwok (fake nodes) and helm; then, through
# hack/node-binaries.sh, CoreDNS and Traefik for the real node. Prints the bin directory last.
#
#   hack/k8s-binaries.sh            # build what is missing, then print the bin dir
#   K8S_HARNESS_CACHE=/x hack/k8s-binaries.sh
#
# k8s.io/kubernetes cannot be `go install`ed (its go.mod replaces the staging modules with local
# paths), so we build it from a throw-away wrapper module that points every staging module at the
# published k8s.io/X v0.<minor>.<patch>. See docs/testing.md.
set -euo pipefail
HACK_DIR=$(cd "$(dirname "$0")" && pwd)  # absolute: the builds below cd into their wrappers
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false
K8S_VERSION=${K8S_VERSION:-v1.36.3}
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
HELM_VERSION=${HELM_VERSION:-v4.3.1}
GATEWAY_API_VERSION=${GATEWAY_API_VERSION:-v1.6.3}
GAIE_VERSION=${GAIE_VERSION:-v1.6.0}
# kube-apiserver 1.36 needs etcd 3.5+ (Debian's 3.4.23 fails its watch-cache progress requests).
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
CACHE=${K8S_HARNESS_CACHE:-$HOME/.cache/kvrail/k8s}
ROOT=$CACHE/$K8S_VERSION
BIN=$ROOT/bin
mkdir -p "$BIN"
log() { echo "k8s-binaries: $*" >&2; }

build_kubernetes() {
  local cmds="kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy" ok=1 c
  for c in $cmds; do
    "$BIN/$c" --version 2>/dev/null | grep -qx "Kubernetes $K8S_VERSION" || ok=0
  done
  [ "$ok" = 1 ] && return 0
  log "building $cmds $K8S_VERSION (cold: ~25 min)"
  local staging="v0.${K8S_VERSION#v1.}" minor="${K8S_VERSION#v1.}"
  minor=${minor%%.*}
  local w=$ROOT/wrapper
  rm -rf "$w" && mkdir -p "$w" && cd "$w"
  go mod init local.invalid/k8sbuild >/dev/null 2>&1
  local up
  up=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  local edits=()
  for m in $(go mod edit -json "$up" | python3 -c 'import json,sys
for r in json.load(sys.stdin).get("Replace") or []:
    if r["New"]["Path"].startswith("./staging/"): print(r["Old"]["Path"])'); do
    edits+=("-replace=$m=$m@$staging")
  done
  for kv in $(go mod edit -json "$up" | python3 -c 'import json,sys
for g in json.load(sys.stdin).get("Godebug") or []: print(g["Key"]+"="+g["Value"])'); do
    edits+=("-godebug=$kv")
  done
  go mod edit "${edits[@]}"
  local pkgs
  pkgs=$(for c in $cmds; do echo "k8s.io/kubernetes/cmd/$c"; done)
  go get $(for p in $pkgs; do echo "$p@$K8S_VERSION"; done)
  local ldf="-s -w" date
  date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldf="$ldf -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean -X $p.buildDate=$date"
  done
  go build -trimpath -p 2 -ldflags "$ldf" -o "$BIN/" $pkgs
  "$BIN/kube-apiserver" --version >&2
}

# etcd, and etcdctl for the real node's etcd image (as quay.io/coreos/etcd has it: for an
# operator's `kubectl exec`; the chart runs none).
build_etcd() {
  if "$BIN/etcd" --version 2>/dev/null | grep -q "etcd Version: ${ETCD_VERSION#v}" \
     && "$BIN/etcdctl" version 2>/dev/null | grep -q "etcdctl version: ${ETCD_VERSION#v}"; then
    return 0
  fi
  log "building etcd and etcdctl $ETCD_VERSION"
  local w=$ROOT/etcd-wrapper
  rm -rf "$w" && mkdir -p "$w" && cd "$w"
  go mod init local.invalid/etcdbuild >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" "go.etcd.io/etcd/etcdctl/v3@$ETCD_VERSION"
  go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
  go build -trimpath -ldflags "-s -w" -o "$BIN/etcdctl" go.etcd.io/etcd/etcdctl/v3
}

build_kwok() {
  if "$BIN/kwok" --version 2>/dev/null | grep -q "${KWOK_VERSION#v}"; then return 0; fi
  log "building kwok $KWOK_VERSION"
  local ldf="-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}"
  GOBIN=$BIN go install -trimpath -ldflags "$ldf" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
}

# KWOK's standalone controller has no built-in stages: collect the default ones from its module zip.
kwok_stages() {
  local out=$ROOT/kwok-stages.yaml
  [ -s "$out" ] && return 0
  local dir
  dir=$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  local s=$dir/kustomize/stage
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    cat "$s/$f"; echo '---'
  done > "$out.tmp" && mv "$out.tmp" "$out"
}

# Gateway API CRDs (HTTPRoute and friends), read from the module zip at test time.
gateway_api() {
  local out=$ROOT/gateway-api
  [ -d "$out" ] && return 0
  local dir
  dir=$(go mod download -json "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  mkdir -p "$out.tmp"
  cp "$dir"/config/crd/standard/gateway.networking.k8s.io_*.yaml "$out.tmp/"
  mv "$out.tmp" "$out"
}

# The Gateway API Inference Extension's InferencePool CRD (inference.networking.k8s.io/v1), read
# from the module zip at test time: kvrail's chart never installs it (the platform does).
gaie() {
  local out=$ROOT/gaie-$GAIE_VERSION
  [ -d "$out" ] && return 0
  local dir
  dir=$(go mod download -json "sigs.k8s.io/gateway-api-inference-extension@$GAIE_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  mkdir -p "$out.tmp"
  cp "$dir"/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml "$out.tmp/"
  mv "$out.tmp" "$out"
}

build_helm() {
  if "$BIN/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then return 0; fi
  log "building helm $HELM_VERSION"
  local major=${HELM_VERSION%%.*}
  GOBIN=$BIN go install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/$major/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/$major/cmd/helm@$HELM_VERSION"
}

case "${1:-all}" in
  all) build_kubernetes; build_etcd; build_kwok; kwok_stages; gateway_api; gaie; build_helm
       "$HACK_DIR/node-binaries.sh" >/dev/null ;;
  kubernetes|etcd|kwok|helm) "build_$1" ;;
  kwok_stages|gateway_api|gaie) "$1" ;;
  *) echo "usage: $0 [all|kubernetes|etcd|kwok|helm|kwok_stages|gateway_api|gaie]" >&2; exit 2 ;;
esac
echo "$BIN"
