#!/usr/bin/env bash
# The base of kvrail's image, made from Debian's packages alone (no registry can be reached from
# these machines): debootstrap's minbase of Debian bookworm plus python3 (3.11), trimmed of apt's
# lists and caches, docs, man pages and translations, committed into buildah's storage as
# localhost/kvrail-base:bookworm-<key>. The key hashes this script, so a change here rebuilds it;
# otherwise a rerun only finds the tag. Prints the image reference on its last line.
#
#   hack/image-base.sh                    # needs root, debootstrap and buildah (make image-deps)
#
# Any Debian bookworm image with python3 on PATH is an equivalent base: `Dockerfile`'s BASE
# argument defaults to python:3.11-slim-bookworm for builds that can pull.
set -euo pipefail
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3
IMAGE_CACHE=${KVRAIL_IMAGE_CACHE:-$HOME/.cache/kvrail/image}
log() { echo "image-base: $*" >&2; }
# shellcheck source=hack/buildah.sh
. "$(dirname "$0")/buildah.sh"

key=$( (cat "$0"; echo "$SUITE $MIRROR $PACKAGES") | sha256sum | cut -c1-12)
ref=localhost/kvrail-base:$SUITE-$key
if bah inspect --type image "$ref" >/dev/null 2>&1; then echo "$ref"; exit 0; fi

log "debootstrap $SUITE minbase + $PACKAGES (cold: ~1 min)"
work=$(mktemp -d "$IMAGE_CACHE/.base-XXXXXX")
trap 'rm -rf "$work"' EXIT
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$work/rootfs" "$MIRROR" > "$work/log" 2>&1 \
  || { tail -20 "$work/log" >&2; exit 1; }
r=$work/rootfs
rm -rf "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/* "$r"/var/cache/debconf/*-old \
  "$r"/usr/share/doc/* "$r"/usr/share/man/* "$r"/usr/share/info/* "$r"/usr/share/locale/* \
  "$r"/var/log/* "$r"/tmp/* "$r"/root/.cache
c=$(bah from scratch)
bah add "$c" "$r" / >/dev/null
bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --label org.opencontainers.image.base.name="debian:$SUITE-minbase" "$c"
bah commit -q --rm "$c" "$ref" >/dev/null
log "built $ref ($(du -sh "$r" | cut -f1))"
echo "$ref"
