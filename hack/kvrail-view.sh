# Sourced: `kvrail_view TREE VIEW` makes VIEW/kvrail import as kvrail.* from TREE's component
# folders, through symlinks, without installing TREE: the package layout `make lint` checks
# (build/view), how the device scripts import this tree (hack/device-env.sh) and the A/B scripts
# an older one (build/old, .old). TREE is an absolute path.
kvrail_view() {
  rm -rf "$2" && mkdir -p "$2/kvrail" || return 1
  for f in "$1"/kvrail/*; do ln -s "$f" "$2/kvrail/"; done
  for d in operator worker router kernels agent cli local testing epp; do
    # A tree from before the re-layout lacks some (its kvrail/testing is already linked);
    # -fn: a top-level folder wins over a kvrail/ entry of the same name.
    [ -d "$1/$d" ] || continue
    ln -sfn "$1/$d" "$2/kvrail/$d"
  done
}
