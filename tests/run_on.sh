#!/usr/bin/env bash
# The whole test suite on another python: `bash tests/run_on.sh python3.10` (any interpreter: a name on PATH or a path). The first time,
# it makes a venv for that python's version in .venvs/ as the README's test command makes .venv (the package and its dev extra,
# fastai 2.8.8 beside them); then it runs tests/run.sh in it. Delete .venvs/pyX.Y to make it again (after a change to the dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:?usage: bash tests/run_on.sh PYTHON, e.g. bash tests/run_on.sh python3.10}; shift
env=.venvs/$("$py" -c 'import sys; print("py%d.%d" % sys.version_info[:2])')
if [ ! -e "$env/ready" ]; then  # made, or its install was cut short: (re)make it
  echo "== making $env with $py"
  rm -rf "$env"
  "$py" -m venv "$env"
  "$env/bin/python" -m pip install -q -e ".[dev]"
  "$env/bin/python" -m pip install -q --no-deps --target "$env/fastai-2.8.8" fastai==2.8.8
  touch "$env/ready"
fi
. "$env/bin/activate"
echo "== $(python -V) in $env"
exec bash tests/run.sh "$@"
