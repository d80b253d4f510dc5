#!/usr/bin/env bash
# FP8 prefill attention on a lent Hopper GPU, in one device command (outputs under $OUT): its GPU
# tests, bench/studies/attention/fp8_attention.py, then the FP8 engine (FP8 weights, e4m3 KV) of this tree
# and of build/old with FP8 attention switched off in its copy (`_FP8_ON_CUDA` in
# worker/layers/attention.py; build/old: `git archive HEAD kvrail operator worker router kernels
# agent cli local testing bench | tar -x -C build/old`), the 8k prefill timed (the path does
# not engage below 4,096 tokens), then this tree's logits and greedy tokens against the bf16
# engine's for a 512- and an 8,192-token prompt (the second attends in FP8; this step needs an
# H200's memory). First run, when the switch was still off in the tree and set here instead:
# bench/studies/attention/fp8_attention_2026-12-05.txt (an H100). Carry `.whl` and `build/old`; from the
# repository root:
#   bash bench/studies/attention/fp8_attention_ab.sh
set -uo pipefail
source hack/device-env.sh >/dev/null || exit 1
sed -i 's/^_FP8_ON_CUDA = True$/_FP8_ON_CUDA = False/' build/old/worker/layers/attention.py
grep -q '^_FP8_ON_CUDA = False$' build/old/worker/layers/attention.py || { echo "no _FP8_ON_CUDA"; exit 1; }
cp bench/engine/gpu_llama3_8b.py build/old/bench/engine/  # its --prefill-only
kvrail_view "$PWD/build/old" /tmp/view-old || exit 1
timeout 120 python3 -P -m pytest -q -p no:cacheprovider tests/unit/kernels/test_fp8_kernels.py \
  tests/unit/worker/test_attention.py -k "rotary or fp8_causal or attend_in_fp8 or mixed_batch" \
  2>&1 | tail -n 6 | tee "$OUT/tests.txt"
timeout 90 python3 -P bench/studies/attention/fp8_attention.py 2>&1 | tee "$OUT/fp8_attention.txt"
fp8=(--quantization fp8 --kv-dtype float8_e4m3fn)
for tree in new old; do
  echo "## engine $tree"
  if [ "$tree" = new ]; then path=/tmp/view; dir=.; else path=/tmp/view-old; dir=build/old; fi
  (cd "$dir" && PYTHONPATH="$path:/tmp/site" timeout 120 python3 -P bench/engine/gpu_llama3_8b.py \
    --skip-transformers --skip-correctness --prefill-only "${fp8[@]}" --kv-gib 30)
done 2>&1 | tee "$OUT/engine_ab.txt"
echo "## correctness new" | tee "$OUT/correctness.txt"
PYTHONPATH="/tmp/view:/tmp/site" timeout 150 python3 -P bench/engine/gpu_llama3_8b.py \
  --skip-transformers --correctness-only --baseline bf16 --kv-gib 12 "${fp8[@]}" \
  --correctness-lengths 512,8192 2>&1 | grep -v "^#" | tee -a "$OUT/correctness.txt"
