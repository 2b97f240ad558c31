#!/usr/bin/env bash
# The whole test suite: notebooks clean and in sync with the modules, then the notebooks' tests, then the process-level tests.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
snap() { git status --porcelain -- nbs resumable_train; git diff -- nbs resumable_train | sha1sum; sha1sum $(git ls-files --others --exclude-standard -- nbs resumable_train) /dev/null; }
before=$(snap)
nbdev-clean
[ "$before" = "$(snap)" ] || { echo "FAIL: nbdev-clean changed notebooks: run nbdev-clean and commit"; git status --porcelain -- nbs; exit 1; }
nbdev-export
[ "$before" = "$(snap)" ] || { echo "FAIL: nbdev-export changed the library: notebooks and modules are out of sync"; git status --porcelain -- resumable_train; exit 1; }
for m in resumable_train/*.py; do
  n=$(basename "$m" .py); case "$n" in __init__|_modidx) continue;; esac
  grep -lq "default_exp $n\b" nbs/*.ipynb || { echo "FAIL: $m has no notebook (#| default_exp $n)"; exit 1; }
done
echo "== notebooks"
# One process per notebook: the notebooks patch fastai's Learner as they run, and nbdev-test's pool would reuse a process for another notebook.
ls nbs/*.ipynb | xargs -P 2 -I{} sh -c 'start=$(date +%s); nbdev-test "{}" >"/tmp/nbtest.$$.$(basename {}).log" 2>&1 && echo "ok   {} ($(( $(date +%s)-start ))s)" || { echo "FAIL {}"; cat "/tmp/nbtest.$$.$(basename {}).log"; exit 255; }'

echo "== process-level tests"
python -m pytest -q tests
