#!/usr/bin/env bash
# kvrail's image, the one every component runs, built from this checkout with buildah and
# `Dockerfile`, cached by content: the tag is a hash of everything that goes in (Dockerfile, these
# scripts, the base, the pinned dependencies, the wheel's files), so a rerun with nothing changed
# only finds the tag, and a change to kvrail rebuilds only the last layers. Prints the image
# reference on its last line. `make image` runs it; the real-node tests call it too.
#
#   hack/image.sh                   # build if needed (root; make image-deps installs buildah)
#   hack/image.sh context           # only prepare build/image/context, for `docker build`
#   hack/image.sh import SOCKET     # build if needed, then load it into the containerd at SOCKET
#                                   # (namespace k8s.io, as the kubelet sees it) unless it is there
#
# Dependencies come from uv's cache (the one `make setup` filled), offline: torch is not
# downloaded twice. Their versions are the ones installed in $VENV, so the image runs exactly what
# the tests ran.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
UV=$VENV/bin/uv
CTX=build/image/context
log() { echo "image: $*" >&2; }
# shellcheck source=hack/buildah.sh
. hack/buildah.sh

[ -x "$UV" ] || { log "no $UV: run make setup first"; exit 1; }
command -v buildah >/dev/null || { log "buildah is not installed: run make image-deps"; exit 1; }

prepare_context() {
  rm -rf "$CTX" && mkdir -p "$CTX"
  "$UV" pip freeze --python "$VENV/bin/python" --exclude-editable > build/image/constraints.txt
  "$UV" pip compile -q --offline --no-header --no-annotate pyproject.toml \
    -c build/image/constraints.txt -o "$CTX/requirements.txt"
  "$UV" build -q --wheel --offline -o "$CTX" . 2>/dev/null
  rm -f "$CTX/.gitignore"
  cp "$UV" "$CTX/uv"
}

# The wheel's member names and bytes, not its timestamps.
wheel_digest() {
  "$VENV/bin/python" -P -c 'import hashlib, sys, zipfile
h = hashlib.sha256()
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in sorted(z.namelist()):
        h.update(name.encode() + b"\0" + z.read(name))
print(h.hexdigest())' "$CTX"/kvrail-*.whl
}

build() {
  local base key ref
  base=$(hack/image-base.sh | tail -1)
  prepare_context
  key=$( { cat Dockerfile hack/image.sh hack/buildah.sh "$CTX/requirements.txt"
           echo "$base"; "$UV" --version; wheel_digest; } | sha256sum | cut -c1-16)
  ref=localhost/kvrail:dev-$key
  if ! bah inspect --type image "$ref" >/dev/null 2>&1; then
    log "building $ref from $base (cold: several minutes, most of it copying torch;" \
      "a new torch layer needs about 13 GB while it is committed: $(df -h --output=avail \
      "$IMAGE_CACHE" | tail -1 | tr -d ' ') free)"
    local start=$SECONDS
    bah bud -q --layers --force-rm --network host -f Dockerfile \
      --build-arg BASE="$base" --build-arg UV_CACHE_DIR=/uv-cache --build-arg UV_OFFLINE=1 \
      -v "${UV_CACHE_DIR:-$HOME/.cache/uv}:/uv-cache" -t "$ref" "$CTX" >/dev/null
    log "built $ref in $((SECONDS - start)) s, $(bah images --format '{{.Size}}' "$ref")"
    forget_older "$ref"
  fi
  echo "$ref"
}

# What older builds left behind: their tags, and the untagged images `--layers` keeps as its cache
# whose layers are not a prefix of this image's (a torch layer of 6.5 GB each time the pinned
# dependencies change). This build's own stay: the next build starts from them.
forget_older() {
  local ref=$1 mine old id layers
  mine=$(diff_ids "$ref")
  for old in $(bah images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/kvrail:dev-' || true); do
    [ "$old" = "$ref" ] || bah rmi "$old" >/dev/null 2>&1 || true
  done
  for id in $(bah images -a --format '{{.ID}} {{.Name}}' | awk '$2 == "<none>" {print $1}'); do
    layers=$(diff_ids "$id") || continue
    [[ $mine == "$layers"* ]] || bah rmi "$id" >/dev/null 2>&1 || true
  done
}

# An image's layer digests, one line: "sha256:... sha256:..." (equal length, so a list that is a
# string prefix of another is a prefix of it layer by layer).
diff_ids() {
  bah inspect --type image --format '{{range .OCIv1.RootFS.DiffIDs}}{{.}} {{end}}' "$1"
}

import_into() {
  local sock=$1 ref start=$SECONDS
  ref=$(build | tail -1)
  ctr_import "$ref" "$sock"
  [ $((SECONDS - start)) -lt 5 ] || log "$ref in containerd at $sock after $((SECONDS - start)) s"
  echo "$ref"
}

case "${1:-build}" in
  build) build ;;
  context) prepare_context; echo "$CTX" ;;
  import) [ $# -eq 2 ] || { echo "usage: $0 import SOCKET" >&2; exit 2; }; import_into "$2" ;;
  *) echo "usage: $0 [build|context|import SOCKET]" >&2; exit 2 ;;
esac
