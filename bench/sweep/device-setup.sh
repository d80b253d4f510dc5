# Source on the lent GPU machine, from the repository root, before a full-stack run
# (bench/sweep/run.py, bench/serving/run.py): hack/device-env.sh (the wheels in .whl/, the
# `kvrail.*` import view), then Debian's etcd and nats-server carried in build/device-carry/
# (bench/sweep/prepare-carry.sh fills it).
source hack/device-env.sh || return 1
mkdir -p /tmp/bin
for b in etcd nats-server; do
  # not carried this call: an earlier call of the same warm machine unpacked it
  [ ! -f "build/device-carry/$b.xz" ] && [ -x "/tmp/bin/$b" ] && continue
  python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' \
    "build/device-carry/$b.xz" "/tmp/bin/$b" && chmod +x "/tmp/bin/$b" || return 1
done
export PATH=/tmp/bin:$PATH HF_HUB_OFFLINE=1
