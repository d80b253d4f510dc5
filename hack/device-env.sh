# Source on the lent GPU machine, from the repository root: installs the wheels carried in .whl/
# (`hack/device-wheels.sh` fills it here) into /tmp/site and makes `kvrail.*` importable through a
# symlink view of the package tree (the layout `make lint` builds), without installing the
# repository. `kvrail_view` makes such a view of another tree (an A/B script's build/old).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
kvrail_view() {  # kvrail_view TREE VIEW: VIEW/kvrail imports as kvrail.* from TREE's folders
  rm -rf "$2" && mkdir -p "$2/kvrail" || return 1
  for f in "$1"/kvrail/*; do ln -s "$f" "$2/kvrail/"; done
  for d in operator worker router kernels agent cli local testing; do  # -fn: over a stale dir
    ln -sfn "$1/$d" "$2/kvrail/$d"
  done
}
kvrail_view "$PWD" /tmp/view || return 1
export PYTHONPATH=/tmp/view:/tmp/site PYTHONUNBUFFERED=1
python3 -P -c "import kvrail.settings, kvrail.worker.engine.engine, kvrail.router.app" || return 1
