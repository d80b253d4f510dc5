#!/usr/bin/env bash
# Build the binaries of a real node that do not come from k8s.io/kubernetes, idempotently, into the
# same cache as hack/k8s-binaries.sh (which builds the kubelet and kube-proxy with the control plane):
# CoreDNS (cluster DNS), Traefik (the Gateway API implementation) and nats-server (the image the
# chart's bundled NATS runs in the tests). Prints the bin dir last.
#
#   hack/node-binaries.sh                 # all three
#   hack/node-binaries.sh coredns|traefik|nats
#
# containerd, runc and the CNI plugins are Debian's packages (`make node-deps`).
set -euo pipefail
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false
K8S_VERSION=${K8S_VERSION:-v1.36.3}
COREDNS_VERSION=${COREDNS_VERSION:-v1.15.0}
TRAEFIK_VERSION=${TRAEFIK_VERSION:-v3.7.13}
# The version charts/kvrail/values.yaml names for nats.image.
NATS_VERSION=${NATS_VERSION:-v2.11.9}
CACHE=${K8S_HARNESS_CACHE:-$HOME/.cache/kvrail/k8s}
ROOT=$CACHE/$K8S_VERSION
BIN=$ROOT/bin
mkdir -p "$BIN"
log() { echo "node-binaries: $*" >&2; }
gomod() { go mod download -json "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])'; }

# CoreDNS's go.mod has no replace directives, so `go install` builds it against its own go.mod.
build_coredns() {
  if "$BIN/coredns" -version 2>/dev/null | grep -q "CoreDNS-${COREDNS_VERSION#v}"; then return 0; fi
  log "building coredns $COREDNS_VERSION (cold: ~5 min)"
  GOBIN=$BIN go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@$COREDNS_VERSION"
}

build_nats() {
  if "$BIN/nats-server" --version 2>/dev/null | grep -q "v${NATS_VERSION#v}$"; then return 0; fi
  log "building nats-server $NATS_VERSION"
  GOBIN=$BIN go install -trimpath -ldflags "-s -w" "github.com/nats-io/nats-server/v2@$NATS_VERSION"
}

# Traefik's go.mod replaces two modules with forks and one nested module with a local path
# (github.com/traefik/traefik/dynamic/ext: empty extension structs, not published on its own), so
# `go install` refuses it. Build from a wrapper module that carries the same replace and exclude
# directives and points the nested module at a stub with the two types Traefik embeds. Two more
# substitutions, because the Go module proxy here does not serve every module Traefik needs:
# - ACME's DNS challenge: lego's providers/dns imports ~220 DNS providers' SDKs and 14 of them are
#   not served. The build uses lego from the module cache with that one package replaced by a
#   stub whose NewDNSChallengeProviderByName returns an error (ACME is unused here: no TLS, no
#   internet); every other lego package is unchanged.
# - Basic/digest auth: the containous fork of go-http-auth is not served; upstream v0.4.0 is, and
#   gets the fork's two additions Traefik calls (CheckSecret, RequireAuthStale).
# Neither touches the Gateway API provider, the router or the proxy.
build_traefik() {
  if "$BIN/traefik" version 2>/dev/null | grep -q "${TRAEFIK_VERSION}$"; then return 0; fi
  log "building traefik $TRAEFIK_VERSION (cold: ~10 min)"
  local w=$ROOT/traefik-wrapper up
  rm -rf "$w" && mkdir -p "$w/ext" && cd "$w"
  cat > ext/go.mod <<'EOF'
module github.com/traefik/traefik/dynamic/ext

go 1.24.0
EOF
  cat > ext/ext.go <<'EOF'
// Package ext is the stub of Traefik's extension point: the open-source build has no extensions.
package ext

// HTTP extends dynamic.HTTP.
type HTTP struct{}

// Router extends dynamic.Router.
type Router struct{}
EOF
  go mod init local.invalid/traefikbuild >/dev/null 2>&1
  up=$(gomod "github.com/traefik/traefik/v3@$TRAEFIK_VERSION")
  local edits=()
  while read -r kind a b; do
    case $kind in
      replace) edits+=("-replace=$a=$b") ;;
      exclude) edits+=("-exclude=$a") ;;
    esac
  done < <(go mod edit -json "$up" | python3 -c 'import json,sys
m = json.load(sys.stdin)
for r in m.get("Replace") or []:
    new = "./ext" if r["New"]["Path"].startswith("./") else r["New"]["Path"] + "@" + r["New"]["Version"]
    print("replace", r["Old"]["Path"], new)
for e in m.get("Exclude") or []:
    print("exclude", e["Path"] + "@" + e["Version"], "-")')
  go mod edit "${edits[@]}"
  local lego_version lego
  lego_version=$(go mod edit -json "$up" | python3 -c 'import json,sys
print(next(r["Version"] for r in json.load(sys.stdin)["Require"] if r["Path"] == "github.com/go-acme/lego/v5"))')
  lego=$(go mod download -json "github.com/go-acme/lego/v5@$lego_version" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  cp -r "$lego" lego && chmod -R u+w lego && rm -rf lego/providers/dns lego/cmd && mkdir lego/providers/dns
  cat > lego/providers/dns/dns.go <<'EOF'
// Package dns stands in for lego's DNS challenge providers, which this build leaves out.
package dns

import (
	"fmt"

	"github.com/go-acme/lego/v5/challenge"
)

// NewDNSChallengeProviderByName refuses every provider: none is built in.
func NewDNSChallengeProviderByName(name string) (challenge.Provider, error) {
	return nil, fmt.Errorf("dns challenge provider %q: not built into this Traefik", name)
}
EOF
  local auth
  auth=$(go mod download -json github.com/abbot/go-http-auth@v0.4.0 | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  cp -r "$auth" auth && chmod -R u+w auth
  printf 'module github.com/abbot/go-http-auth\n\ngo 1.20\n' > auth/go.mod
  # The fork's two additions that Traefik calls, written on v0.4.0's own comparison table.
  cat > auth/fork_compat.go <<'EOF'
package auth

import (
	"net/http"
	"strings"
)

// CheckSecret reports whether password matches secret, an htpasswd entry (MD5, {SHA} or bcrypt).
func CheckSecret(password, secret string) bool {
	compare := compareFuncs[0].compare
	for _, cmp := range compareFuncs[1:] {
		if strings.HasPrefix(secret, cmp.prefix) {
			compare = cmp.compare
			break
		}
	}
	return compare([]byte(secret), []byte(password)) == nil
}

// RequireAuthStale answers as RequireAuth does (a fresh challenge).
func (a *DigestAuth) RequireAuthStale(w http.ResponseWriter, r *http.Request) {
	a.RequireAuth(w, r)
}
EOF
  go mod edit -replace=github.com/go-acme/lego/v5=./lego -replace=github.com/abbot/go-http-auth=./auth
  go get "github.com/traefik/traefik/v3/cmd/traefik@$TRAEFIK_VERSION"
  go build -trimpath -p 2 \
    -ldflags "-s -w -X github.com/traefik/traefik/v3/pkg/version.Version=$TRAEFIK_VERSION" \
    -o "$BIN/traefik" github.com/traefik/traefik/v3/cmd/traefik
}

case "${1:-all}" in
  all) build_coredns; build_traefik; build_nats ;;
  coredns|traefik|nats) "build_$1" ;;
  *) echo "usage: $0 [all|coredns|traefik|nats]" >&2; exit 2 ;;
esac
echo "$BIN"
