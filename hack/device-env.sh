# Source on the lent GPU machine, from the repository root: installs the carried wheels (.whl)
# into /tmp/site and makes `kvrail.*` importable through a symlink view of the package tree
# (the same layout `make lint` builds), without installing the repository.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
rm -rf /tmp/view && mkdir -p /tmp/view/kvrail
for f in "$PWD"/kvrail/*; do ln -s "$f" /tmp/view/kvrail/; done
for d in operator worker router kernels; do ln -s "$PWD/$d" "/tmp/view/kvrail/$d"; done
export PYTHONPATH=/tmp/view:/tmp/site PYTHONUNBUFFERED=1
