# Sourced by the image scripts: buildah with its storage under the kvrail image cache, so images
# persist between runs (layers are reused) and nothing is written to /var/lib/containers.
# overlay keeps one copy of each layer's files; KVRAIL_BUILDAH_DRIVER=vfs where overlay fails.
IMAGE_CACHE=${KVRAIL_IMAGE_CACHE:-$HOME/.cache/kvrail/image}
mkdir -p "$IMAGE_CACHE"
HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # absolute: callers may cd later
bah() {
  buildah --storage-driver "${KVRAIL_BUILDAH_DRIVER:-overlay}" \
    --root "$IMAGE_CACHE/storage" --runroot "$IMAGE_CACHE/run" "$@"
}

# Load image $1 from buildah's storage into the containerd at socket $2 (namespace k8s.io, where
# the kubelet looks), unless it is there already: copied first into an OCI layout under the cache
# with uncompressed layers (skopeo reuses the blobs already there), then streamed to containerd
# with only the layers it lacks (hack/oci_import.py). A change to kvrail moves ~100 MB, not 6.5 GB.
ctr_import() {
  local ref=$1 sock=$2 storage
  if ctr -a "$sock" -n k8s.io images ls -q | grep -qx "$ref"; then return 0; fi
  storage="containers-storage:[${KVRAIL_BUILDAH_DRIVER:-overlay}@$IMAGE_CACHE/storage+$IMAGE_CACHE/run]"
  skopeo copy -q --dest-oci-accept-uncompressed-layers "$storage$ref" "oci:$IMAGE_CACHE/oci:$ref"
  python3 "$HACK_DIR/oci_import.py" "$IMAGE_CACHE/oci" "$ref" "$sock"
}
