#!/usr/bin/env bash
# The issue-23 and issue-22 measurements on a lent H200, in one device command (outputs under
# $OUT). Carry `.whl`, `build/device-carry` and, for the before/after of the token path, `.old`
# (the tree at faabd2a, before the re-layout: `git archive faabd2a kvrail operator worker router
# kernels bench/engine | tar -x -C .old`). Usage, from the repository root:
#   bash bench/serving/h200.sh service-step   # EngineService at 32/128/256 running, old and new
#   bash bench/serving/h200.sh serving        # bench/serving/run.py, Llama-3-8B shape
#   bash bench/serving/h200.sh serving-ab     # the stack of build/old, then this tree's (NEW_MODES=stack
#     NEW_CONCURRENCY=32,256: the same points as the old tree's alone, inside one call's 10 minutes;
#     the clients in CLIENT_PROCS processes, default 4)
#   bash bench/serving/h200.sh profile        # py-spy on the worker and a router, 256 streams
#   bash bench/serving/h200.sh chat-profile   # py-spy on both under chat 600/200 at 32 req/s
#   bash bench/serving/h200.sh remote-ab      # remote prefill, build/old then this tree, + local
#     (RATES=16: the chat sweep at 16 req/s only; ROUNDS=2: this tree's two runs twice;
#     SKIP_OLD=1: without build/old's run)
#   bash bench/serving/h200.sh remote-local   # the 500-token workload remote, then local
#   SETUPS=colocated,disaggregated bash bench/serving/h200.sh vs-vllm   # the chat sweep; then,
#   SETUPS=vllm bash bench/serving/h200.sh vs-vllm    # once vLLM is in /tmp/vsite, vllm serve on
#     the same model, client and requests (bench/sweep/README.md has the lease's call sequence)
set -uo pipefail
source hack/device-env.sh || exit 1
export PYTHONUNBUFFERED=1
# issue 23's remote-prefill workload: 500-token prompts, 200 tokens out, 16 req/s, 160 requests
LONG=(--long-prompt 500 --long-output 200 --long-rates 16 --long-requests 160 --long-tail-s 10)
case "${1:?what to run}" in
  service-step)
    if [ -d .old ]; then  # the old tree, through a view of its own layout
      kvrail_view "$PWD/.old" /tmp/view-old || exit 1
      (cd .old && PYTHONPATH=/tmp/view-old:/tmp/site python3 -P bench/engine/gpu_service_step.py \
         --sizes 32,128,256) | tee "$OUT/service_step_before.txt"
    fi
    python3 -P bench/engine/gpu_service_step.py --sizes 32,128,256 | tee "$OUT/service_step_after.txt"
    ;;
  serving)
    source bench/sweep/device-setup.sh || exit 1
    python3 -P bench/serving/run.py --device cuda --shape llama3-8b --concurrency 1,32,256 --routers 4 \
      --steps 48 --work /tmp/serving --out "$OUT/serving_h200.json" 2>&1 | tee "$OUT/serving_h200.log" | tail -n 40
    cp /tmp/serving/logs/worker-0.0.log "$OUT/" 2>/dev/null || true
    ;;
  serving-ab)  # the stack of build/old (`git archive REV kvrail operator worker router kernels
    # agent cli local testing | tar -x -C build/old`) then this tree's, on one random model
    source bench/sweep/device-setup.sh || exit 1
    kvrail_view "$PWD/build/old" /tmp/view-old || exit 1
    args=(--device cuda --shape llama3-8b --routers 4 --steps "${STEPS:-100}"
          --client-procs "${CLIENT_PROCS:-4}")  # one client process saturates near 22k tok/s
    PYTHONPATH=/tmp/view-old:/tmp/site python3 -P bench/serving/run.py "${args[@]}" \
      --concurrency "${OLD_CONCURRENCY:-32,256}" --modes stack --work /tmp/s-old \
      --out "$OUT/serving_before.json" > "$OUT/serving_before.log" 2>&1
    tail -n 3 "$OUT/serving_before.log"
    mkdir -p /tmp/s-new && ln -sfn /tmp/s-old/model-llama3-8b /tmp/s-new/model-llama3-8b
    python3 -P bench/serving/run.py "${args[@]}" --concurrency "${NEW_CONCURRENCY:-1,32,256}" \
      --modes "${NEW_MODES:-engine,service,stack}" --work /tmp/s-new --out "$OUT/serving_after.json" \
      > "$OUT/serving_after.log" 2>&1
    tail -n 4 "$OUT/serving_after.log"
    cp /tmp/s-old/logs/worker-0.0.log "$OUT/worker_before.log" 2>/dev/null || true
    cp /tmp/s-new/logs/worker-0.0.log "$OUT/worker_after.log" 2>/dev/null || true
    ;;
  profile)  # the stack alone at 256 streams, long enough to sample 8 s of its window
    source bench/sweep/device-setup.sh || exit 1
    rm -rf /tmp/profile
    python3 -P bench/serving/run.py --device cuda --shape llama3-8b --concurrency 256 --routers 4 \
      --steps 300 --modes stack --work /tmp/profile --out "$OUT/profile_stack.json" \
      > "$OUT/profile_run.log" 2>&1 &
    bench=$!
    for _ in $(seq 1200); do  # inside the window: every stream (and the 2 warm-ups) has a token
      n=$(grep -cs "first token" /tmp/profile/logs/worker-0.0.log); [ "${n:-0}" -ge 258 ] && break
      sleep 0.5
    done
    sleep 1
    worker=$(pgrep -f "kvrail.worker --role" | head -n 1)
    router=$(pgrep -f "kvrail.router" | head -n 1)
    cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null
    /tmp/site/bin/py-spy record --pid "$worker" --duration 8 --rate 200 --format raw --threads \
      --output "$OUT/worker.txt" > "$OUT/pyspy_worker.log" 2>&1 &
    /tmp/site/bin/py-spy record --pid "$router" --duration 8 --rate 200 --format raw \
      --output "$OUT/router.txt" > "$OUT/pyspy_router.log" 2>&1
    wait
    cp /tmp/profile/logs/worker-0.0.log "$OUT/" 2>/dev/null || true
    ;;
  chat-profile)  # colocated, budget 1,024, 640 chat requests at 32 req/s: 8 s of its window
    source bench/sweep/device-setup.sh || exit 1
    python3 -P bench/sweep/run.py --setups colocated --workloads chat --chat-prompt 600 \
      --chat-output 200 --chat-rates 32 --chat-requests 640 --chunk-tokens 1024 \
      --out "$OUT/chat_profile.json" > "$OUT/chat_profile.log" 2>&1 &
    for _ in $(seq 1200); do
      grep -qs "warm-up chat done" "$OUT/chat_profile.log" && break
      sleep 0.5
    done
    sleep 5
    worker=$(pgrep -f "kvrail.worker --role" | head -n 1)
    router=$(pgrep -f "kvrail.router" | head -n 1)
    /tmp/site/bin/py-spy record --pid "$worker" --duration 8 --rate 100 --format raw --threads \
      --output /tmp/worker.txt > "$OUT/pyspy_worker.log" 2>&1 &
    /tmp/site/bin/py-spy record --pid "$router" --duration 8 --rate 100 --format raw \
      --output /tmp/router.txt > "$OUT/pyspy_router.log" 2>&1
    wait
    for f in worker router; do
      python3 bench/serving/pyspy_summary.py /tmp/$f.txt --top 40 > "$OUT/pyspy_$f.txt" 2>&1
    done
    ;;
  remote-ab)  # issue 23's remote-prefill target and the disaggregated chat sweep (every prompt
    # remote): the tree in build/old, then this one, then this one prefilling every prompt locally
    # on the decode worker (same processes) as the TTFT baseline. "long" is a 500-token workload.
    source bench/sweep/device-setup.sh || exit 1
    work=(--workloads chat,long --chat-prompt 600 --chat-output 200 --chat-rates "${RATES:-16,32,inf}"
          "${LONG[@]}")
    if [ -z "${SKIP_OLD:-}" ]; then  # SKIP_OLD=1: this tree only (a second call of one lease)
      kvrail_view "$PWD/build/old" /tmp/view-old || exit 1
      PYTHONPATH=/tmp/view-old:/tmp/site timeout 230 python3 -P bench/sweep/run.py --setups disaggregated \
        --min-remote-prefill-tokens 0 --tag=-before "${work[@]}" --budget-s 200 \
        --out "$OUT/remote_before.json" > "$OUT/remote_before.log" 2>&1
      tail -n 12 "$OUT/remote_before.log"
    fi
    for round in $(seq "${ROUNDS:-1}"); do  # ROUNDS=2: this tree's remote and local runs twice
      sfx=$([ "$round" = 1 ] || echo "-$round")
      timeout 230 python3 -P bench/sweep/run.py --setups disaggregated --min-remote-prefill-tokens 0 \
        "${work[@]}" --budget-s 200 --out "$OUT/remote_after$sfx.json" > "$OUT/remote_after$sfx.log" 2>&1
      tail -n 12 "$OUT/remote_after$sfx.log"
      timeout 150 python3 -P bench/sweep/run.py --setups disaggregated --min-remote-prefill-tokens 100000 \
        --tag=-local --workloads long "${LONG[@]}" --budget-s 140 --out "$OUT/local$sfx.json" \
        > "$OUT/local$sfx.log" 2>&1
      tail -n 8 "$OUT/local$sfx.log"
    done
    ;;
  remote-local)  # issue 23's remote-prefill target alone (the 500-token workload at 16 req/s):
    # every prompt prefilled remotely, then every prompt locally on the decode worker
    source bench/sweep/device-setup.sh || exit 1
    long=(--workloads long "${LONG[@]}" --budget-s 190)
    for min in 0 100000; do
      name=$([ "$min" = 0 ] && echo remote || echo local)
      timeout 200 python3 -P bench/sweep/run.py --setups disaggregated --min-remote-prefill-tokens \
        "$min" --tag="-$name" "${long[@]}" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
      tail -n 6 "$OUT/$name.log"
    done
    ;;
  vs-vllm)  # issue 23's side by side: the chat sweep of run.py's setups in $SETUPS; its `vllm`
    # setup needs vLLM installed in /tmp/vsite (the vLLM recipe's bundle and device-install.sh).
    # The random model's folder stays in /tmp for the next call of the same lease.
    source bench/sweep/device-setup.sh || exit 1
    setups=${SETUPS:?the setups of run.py to run, e.g. colocated,disaggregated or vllm}
    VLLM_USE_FLASHINFER_SAMPLER=0 timeout 570 python3 -P bench/sweep/run.py --setups "$setups" \
      --workloads chat --chat-prompt 600 --chat-output 200 --chat-rates "${RATES:-8,16,32,inf}" \
      --chunk-tokens 1024 --vllm-pythonpath /tmp/vsite --budget-s "${BUDGET_S:-540}" \
      --client-processes "${CLIENTS:-4}" --routers "${ROUTERS:-1}" \
      --logs "$OUT/logs-${setups//,/-}.tar.gz" --out "$OUT/kvrail-${setups//,/-}.json" \
      > "$OUT/vs-vllm-${setups//,/-}.log" 2>&1
    tail -n 16 "$OUT/vs-vllm-${setups//,/-}.log"
    ;;
esac
