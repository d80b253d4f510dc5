#!/usr/bin/env bash
# What installing each grammar library brings: the wheel for this CPython, its size, what it
# requires and what a resolver pulls into an empty venv, the installed size, the import time
# and what the import drags in (kvrail's router never imports torch), and the license.
#
#     bash bench/studies/grammar/install.sh | tee bench/studies/grammar/install.txt
#
# It makes the scratch venv /tmp/gvenv (if missing) with the CPython of .venv and installs
# xgrammar and llguidance there (PyPI; the uv cache makes a repeat quick), then looks into
# throw-away empty venvs with `uv pip install --dry-run` for what each pulls alone.
set -euo pipefail
cd "$(dirname "$0")/../../.."
UV=.venv/bin/uv
PY=$(.venv/bin/python -P -c 'import sys; print(sys.executable)')
PY=$(readlink -f "$PY")
VENV=${GRAMMAR_VENV:-/tmp/gvenv}
echo "python: $("$PY" -V) ($PY); $(ldd --version | head -1); uv $($UV --version | cut -d' ' -f2)"
[ -x "$VENV/bin/python" ] || $UV venv -q -p "$PY" "$VENV"
$UV pip install -q -p "$VENV/bin/python" xgrammar llguidance

echo
echo "== wheels chosen for this interpreter (pip download --no-deps)"
WHEELS=$(mktemp -d)
.venv/bin/pip download -q --no-deps -d "$WHEELS" \
  "xgrammar==$("$VENV/bin/python" -P -c 'import importlib.metadata as m; print(m.version("xgrammar"))')" \
  "llguidance==$("$VENV/bin/python" -P -c 'import importlib.metadata as m; print(m.version("llguidance"))')" \
  "apache-tvm-ffi==$("$VENV/bin/python" -P -c 'import importlib.metadata as m; print(m.version("apache-tvm-ffi"))')"
for w in "$WHEELS"/*.whl; do
  printf "%-90s %6.1f MB\n" "$(basename "$w")" "$(awk "BEGIN { print $(stat -c %s "$w") / 1e6 }")"
done
rm -rf "$WHEELS"

SITE=$("$VENV/bin/python" -P -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for pkg in xgrammar llguidance; do
  echo
  echo "== $pkg"
  dist=$(ls -d "$SITE"/"$pkg"-*.dist-info)
  grep -E '^(Version|License|License-Expression):' "$dist/METADATA" || true
  echo "license files: $(ls "$dist"/licenses/ | tr '\n' ' ')-- LICENSE begins:" \
    "$(grep -m 2 -v '^ *$' "$dist"/licenses/LICENSE | tr -s ' \n' ' ')"
  echo "Requires-Dist (no extras):"
  grep '^Requires-Dist:' "$dist/METADATA" | grep -v 'extra ==' | sed 's/^/  /' || echo "  (none)"
  EMPTY=$(mktemp -d)
  $UV venv -q -p "$PY" "$EMPTY/v"
  pulled=$($UV pip install -p "$EMPTY/v/bin/python" --dry-run "$pkg" 2>&1 | grep '^ + ' | sed 's/^ + //')
  rm -rf "$EMPTY"
  echo "an empty venv would get $(echo "$pulled" | wc -l) packages:"
  echo "$pulled" | tr '\n' ' ' | fold -s -w 100 | sed 's/^/  /'
  echo
  echo "torch among them: $(echo "$pulled" | grep -E '^torch==' || echo no);" \
    "CUDA wheels (nvidia-*): $(echo "$pulled" | grep -c '^nvidia-' || true)"
  echo "installed size: $(du -sh "$SITE/$pkg" | cut -f1) (package itself)"
done
echo
echo "installed size of what xgrammar pulls in besides: tvm_ffi $(du -sh "$SITE/tvm_ffi" | cut -f1)," \
  "torch $(du -sh "$SITE/torch" | cut -f1), triton $(du -sh "$SITE/triton" | cut -f1)," \
  "nvidia $(du -sh "$SITE/nvidia" | cut -f1), transformers $(du -sh "$SITE/transformers" | cut -f1)"

echo
echo "== import (cold file cache aside; a CI run shares the 2 cores)"
for mod in llguidance llguidance.torch xgrammar; do
  "$VENV/bin/python" -P -W ignore -c "
import sys, time
start = time.perf_counter()
import $mod
took = time.perf_counter() - start
pulled = [m for m in ('torch', 'transformers', 'triton', 'numpy') if m in sys.modules]
print(f'import $mod: {took:.2f} s; brings in: {\", \".join(pulled) or \"nothing of torch, transformers, triton, numpy\"}')
"
done
