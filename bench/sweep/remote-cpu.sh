#!/usr/bin/env bash
# Remote against local prefill on the CPU (issue 23's remote-prefill target, scaled down): the
# disaggregated setup with the tiny random model, 500-token prompts, every prompt prefilled
# remotely (`--min-remote-prefill-tokens 0`), then every prompt prefilled on the decode worker
# (same processes), and, when build/old holds an older tree (`git archive REV kvrail operator
# worker router kernels agent cli local testing | tar -x -C build/old`), that tree's remote run
# first. ROUNDS rounds, alternating; JSON and logs under $1. Then:
#   .venv/bin/python -P bench/sweep/stages.py DIR/*.json
set -euo pipefail
out=${1:?output folder}
mkdir -p "$out"
common=(--cpu --shape tiny --model-dir /tmp/kvrail-sweep/tiny --setups disaggregated
  --workloads long --long-prompt 500 --long-output 16 --long-rates "${RATES:-4,16}"
  --long-requests "${N:-80}" --long-tail-s 5 --torch-threads 1 --max-model-len 1024
  --kv-blocks 4096 --prefill-kv-blocks 4096 --chunk-tokens 2048 --prefill-tokens 2048
  --warmup-requests 8)
py=.venv/bin/python
if [ -d build/old ]; then
  source hack/kvrail-view.sh && kvrail_view "$PWD/build/old" /tmp/view-old || exit 1
fi
for round in $(seq 1 "${ROUNDS:-3}"); do
  if [ -d build/old ]; then
    PYTHONPATH=/tmp/view-old $py -P bench/sweep/run.py "${common[@]}" --min-remote-prefill-tokens 0 \
      --tag=-before --out "$out/before-$round.json" > "$out/before-$round.log" 2>&1
  fi
  $py -P bench/sweep/run.py "${common[@]}" --min-remote-prefill-tokens 0 \
    --out "$out/after-$round.json" > "$out/after-$round.log" 2>&1
  $py -P bench/sweep/run.py "${common[@]}" --min-remote-prefill-tokens 100000 --tag=-local \
    --out "$out/local-$round.json" > "$out/local-$round.log" 2>&1
done
