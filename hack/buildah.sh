# Sourced by the image scripts: buildah with its storage under the kvrail image cache, so images
# persist between runs (layers are reused) and nothing is written to /var/lib/containers.
# overlay keeps one copy of each layer's files; KVRAIL_BUILDAH_DRIVER=vfs where overlay fails.
IMAGE_CACHE=${KVRAIL_IMAGE_CACHE:-$HOME/.cache/kvrail/image}
mkdir -p "$IMAGE_CACHE"
bah() {
  buildah --storage-driver "${KVRAIL_BUILDAH_DRIVER:-overlay}" \
    --root "$IMAGE_CACHE/storage" --runroot "$IMAGE_CACHE/run" "$@"
}

# Load image $1 from buildah's storage into the containerd at socket $2 (namespace k8s.io, where
# the kubelet looks), unless it is there already.
ctr_import() {
  local ref=$1 sock=$2 tmp rc=0
  if ctr -a "$sock" -n k8s.io images ls -q | grep -qx "$ref"; then return 0; fi
  tmp=$(mktemp -d "$IMAGE_CACHE/.export-XXXXXX")
  bah push -q --disable-compression "$ref" "oci-archive:$tmp/image.tar:$ref" >/dev/null \
    && ctr -a "$sock" -n k8s.io images import "$tmp/image.tar" >/dev/null || rc=$?
  rm -rf "$tmp"
  return "$rc"
}
