# Source on the lent GPU machine, from the repository root: installs the wheels carried in .whl/
# (`hack/device-wheels.sh` fills it here) into /tmp/site and makes `kvrail.*` importable through a
# symlink view of the package tree (the layout `make lint` builds), without installing the
# repository.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
rm -rf /tmp/view && mkdir -p /tmp/view/kvrail
for f in "$PWD"/kvrail/*; do ln -s "$f" /tmp/view/kvrail/; done
for d in operator worker router kernels agent cli local testing; do  # -fn: over a stale copy's dir
  ln -sfn "$PWD/$d" "/tmp/view/kvrail/$d"
done
export PYTHONPATH=/tmp/view:/tmp/site PYTHONUNBUFFERED=1
python3 -P -c "import kvrail.settings, kvrail.worker.engine.engine, kvrail.router.app" || return 1
