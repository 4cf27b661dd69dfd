#!/usr/bin/env bash
# MLflow's tracking server for the tests (tests/test_mlflow.cpp starts one on the loopback, SQLite backend)
# and its Python client, which reads what the trainer logged: a virtual environment made once and reused.
# The trainer itself needs none of it (it speaks MLflow's REST API through libcurl).
#
#   scripts/install-mlflow.sh            create or reuse the environment; print its python
#
# TRAINER_MLFLOW_VENV picks the folder (default ~/.cache/trainer/mlflow-<version>). The first run downloads
# about 150 MB from PyPI (a minute); progress goes to stderr, the answer to stdout.
set -euo pipefail

pins=(mlflow==3.17.2)
venv=${TRAINER_MLFLOW_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/trainer/mlflow-3.17.2}
stamp="$venv/.trainer-pins"
case ${1:-} in
  ""|--python) ;;
  *) echo "usage: scripts/install-mlflow.sh [--python]" >&2; exit 2 ;;
esac
if [[ ! -f $stamp || $(cat "$stamp") != "${pins[*]}" ]]; then
  py=/usr/bin/python3
  [[ -x $py ]] || py=$(command -v python3)
  echo "install-mlflow: creating $venv (${pins[*]})" >&2
  start=$SECONDS
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv" >&2 || { echo "install-mlflow: '$py -m venv' failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
  "$venv/bin/pip" install --no-cache-dir --progress-bar off -q "${pins[@]}" >&2
  echo "${pins[*]}" > "$stamp"
  echo "install-mlflow: done in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))" >&2
fi
echo "$venv/bin/python"
