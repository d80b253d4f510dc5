#!/usr/bin/env bash
# This tree ("new") against others in one device command, outputs under $OUT. A tree NAME other
# than new lives in build/NAME (another commit's: `git archive REV kvrail operator worker router
# kernels agent cli local testing bench | tar -x -C build/NAME`); AB_TREES lists them
# (default: new old). In order:
# - with AB_HANDOFF=1, the KV handoff of an 8k prompt (bench/transfer/handoff.py: FP8, 512 x 1
#   MiB blocks, and bf16, 512 x 2 MiB, scattered, over CUDA IPC; median of 20 writes) of each
#   tree in AB_HANDOFF_TREES (default: new old), alternating twice, then
#   bench/studies/handoff/ipc_split.py in this tree;
# - unless AB_MICRO=0, decode attention's default launch at 1, 32 and 256 sequences over an FP8
#   and a bf16 cache (decode_attention_sweep.py --default-only), the trees alternating twice;
#   AB_REGISTER_CAPS="96 80" also times this tree's launch with those register caps
#   (--max-registers);
# - unless AB_ENGINE=0, the FP8 engine (FP8 weights, e4m3 KV: batch 1, 32 and 256 x 512/128, the
#   8k prefill) of each tree in AB_ENGINE_TREES (default: AB_TREES).
# Carry `.whl` and the build/ trees; from the repository root:
#   AB_TREES="new old" bash bench/studies/tree_ab.sh
# First run: bench/studies/attention/decode_attention_sweep.txt's last section and
# bench/transfer/handoff-graph-h100-2026-12-05/.
set -uo pipefail
source hack/device-env.sh >/dev/null || exit 1
read -r -a trees <<< "${AB_TREES:-new old}"
read -r -a engine_trees <<< "${AB_ENGINE_TREES:-${trees[*]}}"
read -r -a handoff_trees <<< "${AB_HANDOFF_TREES:-new old}"
for tree in "${trees[@]}"; do
  [ "$tree" = new ] || kvrail_view "$PWD/build/$tree" "/tmp/view-$tree" || exit 1
done
sweep_in() {  # a tree's decode attention sweep: bench/engine/ before the studies moved
  local dir=.
  [ "$1" = new ] || dir=build/$1
  if [ -f "$dir/bench/studies/attention/decode_attention_sweep.py" ]; then
    echo bench/studies/attention/decode_attention_sweep.py
  else
    echo bench/engine/decode_attention_sweep.py
  fi
}
run_in() {  # tree, then the command
  local tree=$1 path=/tmp/view dir=.
  shift
  if [ "$tree" != new ]; then path=/tmp/view-$tree; dir=build/$tree; fi
  (cd "$dir" && PYTHONPATH="$path:/tmp/site" "$@")
}
if [ "${AB_HANDOFF:-0}" = 1 ]; then
  mkdir -p "$OUT/handoff"
  for round in 1 2; do
    for tree in "${handoff_trees[@]}"; do
      for kv in fp8:512:1024 bf16:1024:2048; do
        IFS=: read -r name mib kib <<< "$kv"
        echo "## handoff, round $round, tree $tree, $name"
        run_in "$tree" timeout 120 python3 -P "$PWD/bench/transfer/handoff.py" --device cuda \
          --sizes-mib "$mib" --block-kib "$kib" --iters 20 --layouts scattered \
          --modes kvrail-cuda-ipc --out "$OUT/handoff/$tree-$name-$round.json"
      done
    done
  done 2>&1 | grep -v "^\s*$" | tee "$OUT/handoff_ab.txt"
  timeout 120 python3 -P bench/studies/handoff/ipc_split.py 2>&1 | tee "$OUT/handoff/ipc_split.txt"
fi
for round in 1 2; do
  [ "${AB_MICRO:-1}" = 0 ] && break
  for tree in "${trees[@]}"; do
    caps=()  # an older tree's sweep has no --max-registers
    [ "$tree" = new ] && [ -n "${AB_REGISTER_CAPS:-}" ] && caps=(--max-registers $AB_REGISTER_CAPS)
    for kv in float8_e4m3fn bfloat16; do
      echo "## decode attention, round $round, tree $tree, $kv cache"
      run_in "$tree" timeout 120 python3 -P "$(sweep_in "$tree")" \
        --default-only --kv-dtype "$kv" --batches 1 32 256 "${caps[@]}"
    done
  done
done 2>&1 | tee "$OUT/decode_attention_ab.txt"
[ "${AB_ENGINE:-1}" = 0 ] && exit 0
for tree in "${engine_trees[@]}"; do
  echo "## engine, tree $tree"
  run_in "$tree" timeout 200 python3 -P bench/engine/gpu_llama3_8b.py --skip-transformers \
    --skip-correctness --quantization fp8 --kv-dtype float8_e4m3fn --kv-gib 30
done 2>&1 | tee "$OUT/engine_ab.txt"
