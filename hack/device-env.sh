# Source on the lent GPU machine, from the repository root: installs the wheels carried in .whl/
# (`hack/device-wheels.sh` fills it here) into /tmp/site and makes `kvrail.*` importable through a
# symlink view of the package tree (the layout `make lint` builds), without installing the
# repository (`kvrail_view`, hack/kvrail-view.sh, which the A/B scripts call for older trees).
# A call that does not carry .whl (the 64 MiB carry limit) reuses what an earlier call of the
# same warm machine installed.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
elif [ ! -d /tmp/site/pydantic ]; then
  echo "no .whl carried and nothing installed in /tmp/site yet: carry .whl" >&2
  return 1
fi
source hack/kvrail-view.sh || return 1
kvrail_view "$PWD" /tmp/view || return 1
export PYTHONPATH=/tmp/view:/tmp/site PYTHONUNBUFFERED=1
python3 -P -c "import kvrail.settings, kvrail.worker.engine.engine, kvrail.router.app" || return 1
