#!/usr/bin/env bash
# Issue 47's KV-tier benchmark on one lent H100/H200 (bench/serving/tiers.py; outputs under $OUT):
# Llama-3-8B shape with random bf16 weights (bench/sweep/model.py, written once into
# /tmp/tiers-model, which later calls of the same warm machine reuse), the same GPU KV budget for
# every system ($KV_BLOCKS blocks of 16 tokens, 2 MiB each: 4 GiB by default) and the same
# multi-turn sessions. One setup per device call, so each stays under the 10-minute limit:
#   bash bench/serving/tiers-gpu.sh probe        # pinned host -> GPU bandwidth alone (torch only)
#   bash bench/serving/tiers-gpu.sh kvrail       # kvrail, no lower tier
#   bash bench/serving/tiers-gpu.sh kvrail-host  # the probe, then kvrail with a $HOST_GIB GiB host tier
#   bash bench/serving/tiers-gpu.sh vllm         # vLLM 0.26, --kv-offloading-size $HOST_GIB
#   bash bench/serving/tiers-gpu.sh dry          # the kvrail setups, tiny shapes, 1 rate (checks)
# Carry `.whl` and `build/device-carry` (hack/device-wheels.sh, bench/sweep/prepare-carry.sh) for
# the kvrail setups; `vllm` needs vLLM installed in /tmp/vsite first (the vLLM bundle, built with
# --serve, and its device-install.sh: the calls in the vLLM recipe's README), then run it in the
# next call of the same warm machine. Environment: RATES (sessions/s, default 0.5,1,2), SESSIONS
# (32), TURNS (6), THINK_S (5), FIRST (2000 words), USER (300-500), OUTPUT (200), KV_BLOCKS (2048),
# HOST_GIB (32), BUDGET_S (tiers.py's timeout: 560 s, 520 after the probe; a point cut short is
# not in the JSON, the points before it are).
set -uo pipefail
what=${1:?probe, kvrail, kvrail-host, vllm or dry}
export PYTHONUNBUFFERED=1
probe() {  # pinned host -> GPU copies of $PROBE_GIB GiB, whole and in KV-block sizes
  python3 -P bench/serving/h2d_probe.py --gib "${PROBE_GIB:-4}" --out "$OUT/h2d.json"
}
if [ "$what" = probe ]; then
  probe
  exit
fi
if [ "$what" = vllm ]; then
  # tiers.py's own imports (kvrail.testing, the loadgen) come from the project's wheels; the
  # vLLM server gets /tmp/vsite alone (--vllm-pythonpath)
  source hack/device-env.sh || exit 1
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  [ -d /tmp/vsite/vllm ] || { echo "vLLM is not installed in /tmp/vsite: run the bundle's calls first"; exit 1; }
else
  source bench/sweep/device-setup.sh || exit 1
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
common=(--device cuda --shape llama3-8b --model-dir /tmp/tiers-model --work "/tmp/tiers-$what"
        --kv-blocks "${KV_BLOCKS:-2048}" --host-tier-gib "${HOST_GIB:-32}" --max-model-len 8192
        --chunk-tokens 2048 --sessions "${SESSIONS:-32}" --turns "${TURNS:-6}"
        --think-s "${THINK_S:-5}" --first-tokens "${FIRST:-2000}" --user-tokens "${USER:-300-500}"
        --output-tokens "${OUTPUT:-200}" --session-rates "${RATES:-0.5,1,2}")
run() {  # $1: the setups; the rest: more arguments
  local setups=$1; shift
  timeout "${BUDGET_S:-$budget}" python3 -P bench/serving/tiers.py "${common[@]}" --setups "$setups" "$@" \
    --out "$OUT/tiers-$setups.json" > "$OUT/tiers-$setups.log" 2>&1
  local rc=$?
  tail -n 12 "$OUT/tiers-$setups.log"
  tar -czf "$OUT/logs-$setups.tar.gz" -C "/tmp/tiers-$what" --exclude js --exclude etcd . 2>/dev/null
  return $rc
}
budget=$([ "$what" = kvrail-host ] && echo 520 || echo 560)  # the probe runs first there
case "$what" in
  kvrail)
    run kvrail
    ;;
  kvrail-host)  # the load bandwidth's ceiling, measured on the machine that runs the tier
    probe
    run kvrail-host
    ;;
  vllm)
    run vllm --vllm-python python3 --vllm-pythonpath /tmp/vsite
    ;;
  dry)  # both kvrail setups end to end on the GPU, small: what the long calls will do
    common+=(--session-rates 2 --sessions 4 --turns 2 --first-tokens 256 --user-tokens 64
             --output-tokens 16 --think-s 0.5 --kv-blocks 64 --host-tier-gib 1 --max-model-len 960)
    run kvrail,kvrail-host
    ;;
  *) echo "unknown: $what"; exit 2 ;;
esac
