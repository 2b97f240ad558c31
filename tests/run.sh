#!/usr/bin/env bash
# The whole test suite: notebooks clean and in sync with the modules, the docs build, every notebook's tests with its outputs current,
# then the process-level tests. `bash tests/run.sh --update-outputs` instead reruns the notebooks and writes their outputs into them.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONHASHSEED=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, even if another is installed
# The notebooks keep outputs (losses, weight digests) that depend on which vector kernels torch picks for this CPU: AVX2's on every x86-64
# machine, so that they are the same on one with AVX-512.
[ "$(uname -m)" != x86_64 ] || export ATEN_CPU_CAPABILITY=avx2
if [ "${1:-}" = --update-outputs ]; then python tests/notebooks.py --update; nbdev-clean; exit; fi
# First, in seconds: torch and torchvision load together (pip's fallback to PyPI's torchvision beside a CPU torch fails every test)
python -c 'import sys; from resumable_train.cli import torch_problem; p = torch_problem(); p and sys.exit(f"FAIL: {p}")'
start=$(date +%s)
logs=$(mktemp -d); trap 'rm -rf "$logs"' EXIT
export TORCHINDUCTOR_CACHE_DIR="$logs/inductor"  # torch's compile cache, which it would leave in the system's temporary folder
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
# The process-level tests run beside the notebooks, in one pytest whose test files are spread over 4 worker processes (pytest-xdist; a
# file's tests stay in one worker, where they share their reference runs): most of those tests wait on processes of their own (kills,
# timeouts, launchers, a server, the pauses that let a kill land in its window): once the notebooks were done, 3 workers kept about 1.2
# of the 2 cores busy, so there are 4. The files go out longest first (their times in a whole run), so that the workers end together; a
# file not in `longest` goes after them.
# Once the notebooks are done, the lowest fastai that pyproject.toml admits (2.8.8): its training loop is the one the package checks at import, and of the
# applications' code only fastai.tabular differs from 2.8.12, so the tabular and collab kill-and-rerun tests run again on it
# (2.8.8's own vision does not run with this torchvision, with or without the package). The README's test command puts it beside the
# venv's packages, not installed; the suite itself installs nothing, and says so when it is missing.
low=$(python -c 'import sys; print(sys.prefix)')/fastai-2.8.8
[ -d "$low/fastai" ] ||
  echo "== skipped: the tests on fastai 2.8.8 ($low is missing; make it with: pip install --no-deps --target $low fastai==2.8.8)"
# Each pytest block says when it starts and when it ends, with its counts, as it happens; a failed block's whole log is shown at the end.
block() {  # block N WHAT ARGS...: pytest ARGS in one process
  local n=$1 what=$2 t0=$(date +%s) rc=0; shift 2
  echo "== pytest $n ($what): started"
  # each test file's counts as it ends, and what still runs when nothing ended for 25 s (tests/conftest.py, on file descriptor 3)
  RESUMABLE_TRAIN_PROGRESS_FD=3 python -m pytest -q -rs -p no:cacheprovider --basetemp="$logs/tmp$n" "$@" 3>&1 >"$logs/pytest$n.log" 2>&1 \
    || rc=$?
  grep '^SKIPPED' "$logs/pytest$n.log" | sed 's/^/   /' || true  # why each skipped test was skipped
  echo "== pytest $n ($what): $(tail -n 1 "$logs/pytest$n.log" | tr -d '=' | sed 's/^ *//') ($(( $(date +%s)-t0 ))s in all)"
  echo $rc >"$logs/rc$n"
  return $rc
}
lowest() {
  [ -d "$low/fastai" ] || return 0
  local v=$(PYTHONPATH="$low:$PYTHONPATH" python -c 'import fastai; print(fastai.__version__)')
  PYTHONPATH="$low:$PYTHONPATH" block 2 "the tabular and collab tests again, on fastai $v" tests/test_apps.py -k 'tabular or collab'
}
longest=(matrix benchmarks random_scripts text apps distributed check fastai_ddp multinode group_signal owned refusals remote signals safety
         trackers streams cli autoresume invisible elastic exact shapes precision cells docs)
files=("${longest[@]/#/tests/test_}"); files=("${files[@]/%/.py}")
for f in tests/test_*.py; do [[ " ${files[*]} " = *" $f "* ]] || files+=("$f"); done
block 1 "every test file, over 4 processes" -n 4 --dist loadfile --no-loadscope-reorder "${files[@]}" & pytest_pid=$!
# The docs: what nbdev-proc-nbs does (the sidebar, each notebook processed for Quarto, show_doc run on every export), without its step
# that downloads Quarto and installs it with sudo where it is missing (the suite installs nothing; if nbdev renames that step, this fails
# with a KeyError instead of installing). Rendering the pages (nbdev-docs) needs Quarto and is not part of the suite. Every notebook is
# processed (`force`: not only those changed since the cache in nbs/_proc), one after the other in one worker: the cells each runs (its
# imports and exports) run after every notebook before it, in the same process, as they may in nbdev's workers (tests/test_docs.py checks
# that those cells run no examples).
echo "== docs build (nbdev-proc-nbs without installing Quarto; the pages are rendered by nbdev-docs, not here)"
proc_nbs='import nbdev.quarto as q; vars(q)["_ensure_quarto"]; q._ensure_quarto = lambda: None
q.nbdev_proc_nbs.__wrapped__(n_workers=1, force=True)'
python -c "$proc_nbs" >"$logs/proc.log" 2>&1 || { cat "$logs/proc.log"; echo "FAIL: nbdev-proc-nbs: the docs do not build"; exit 1; }
echo "== notebooks: tests, and outputs current"
nb_rc=0; python tests/notebooks.py || nb_rc=$?
py_rc=0; lowest || py_rc=$?  # once the notebooks are done
wait $pytest_pid || py_rc=$?
for n in 1 2; do [ "$(cat "$logs/rc$n" 2>/dev/null || echo 0)" = 0 ] || { echo "== pytest $n failed:"; cat "$logs/pytest$n.log"; }; done
echo "== $(( $(date +%s)-start ))s"
[ $nb_rc = 0 ] || { echo "FAIL: notebooks"; exit 1; }
[ $py_rc = 0 ] || { echo "FAIL: process-level tests"; exit 1; }
