# Source on the lent GPU machine, from the repository root, before bench/sweep/run.py:
# hack/device-env.sh (the wheels in .whl/, the `kvrail.*` import view), then what the sweep needs
# besides and the image lacks, carried in build/device-carry/ (bench/sweep/prepare-carry.sh
# fills it): the router's and the load generator's wheels, and Debian's etcd and nats-server.
source hack/device-env.sh || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site build/device-carry/whl/*.whl || return 1
mkdir -p /tmp/bin
for b in etcd nats-server; do
  python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' \
    "build/device-carry/$b.xz" "/tmp/bin/$b" && chmod +x "/tmp/bin/$b" || return 1
done
export PATH=/tmp/bin:$PATH HF_HUB_OFFLINE=1
