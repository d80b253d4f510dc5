#!/usr/bin/env bash
# The issue-23 and issue-22 measurements on a lent H200, in one device command (outputs under
# $OUT). Carry `.whl`, `build/device-carry` and, for the before/after of the token path, `.old`
# (the tree at faabd2a, before the re-layout: `git archive faabd2a kvrail operator worker router
# kernels bench/engine | tar -x -C .old`). Usage, from the repository root:
#   bash bench/serving/h200.sh service-step   # EngineService at 32/128/256 running, old and new
#   bash bench/serving/h200.sh serving        # bench/serving/run.py, Llama-3-8B shape
set -uo pipefail
source hack/device-env.sh || exit 1
export PYTHONUNBUFFERED=1
case "${1:?what to run}" in
  service-step)
    if [ -d .old ]; then  # the old tree, through a view of its own layout
      rm -rf /tmp/view-old && mkdir -p /tmp/view-old/kvrail
      for f in "$PWD"/.old/kvrail/*; do ln -s "$f" /tmp/view-old/kvrail/; done
      for d in operator worker router kernels; do ln -s "$PWD/.old/$d" /tmp/view-old/kvrail/$d; done
      (cd .old && PYTHONPATH=/tmp/view-old:/tmp/site python3 -P bench/engine/gpu_service_step.py \
         --sizes 32,128,256) | tee "$OUT/service_step_before.txt"
    fi
    python3 -P bench/engine/gpu_service_step.py --sizes 32,128,256 | tee "$OUT/service_step_after.txt"
    ;;
  serving)
    source bench/sweep/device-setup.sh || exit 1
    python3 -P bench/serving/run.py --device cuda --shape llama3-8b --concurrency 1,32,256 --routers 4 \
      --steps 48 --work /tmp/serving --out "$OUT/serving_h200.json" 2>&1 | tee "$OUT/serving_h200.log" | tail -n 40
    cp /tmp/serving/logs/*.log "$OUT/" 2>/dev/null || true
    ;;
esac
