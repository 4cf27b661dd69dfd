#!/usr/bin/env bash
# Names every product function over 80 lines (docs/ARCHITECTURE.md, "Function length"): the C++ of app/,
# common/, data/, models/, trainer/, tools/ and fuzz/ (not tests/), measured by lizard from PyPI. A
# function's length is lizard's: from its first line to its closing brace, comments included. A long
# function is made shorter by naming its parts, not by squeezing lines.
#
# First, and without lizard, every product source file over 600 lines (docs/ARCHITECTURE.md, "File
# length"): each .cpp, .h and .cu of the same folders, its lines as wc counts them. A long file is split
# along its seams into files of the same component, whole functions moved, not lines squeezed.
#
# lizard lives in a virtual environment of its own, made the first time and reused after
# (TRAINER_LIZARD_VENV, default ~/.cache/trainer/lizard-<version>); a check then takes under a second.
# Exit 1 names the files and the functions, one line each; exit 2 when lizard cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
version=1.24.3
max_lines=80
max_file_lines=600

status=0
long_files=0
while IFS= read -r -d '' f; do
  n=$(wc -l < "$f")
  if (( n > max_file_lines )); then
    echo "$f is $n lines, over $max_file_lines: split it into parts"
    long_files=$((long_files + 1))
  fi
done < <(find app common data models trainer tools fuzz -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' \) \
           -print0 | sort -z)
if (( long_files > 0 )); then
  echo "error: $long_files file(s) over $max_file_lines lines: split them along their seams" \
       "(docs/ARCHITECTURE.md, \"File length\")"
  status=1
fi

venv=${TRAINER_LIZARD_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/trainer/lizard-$version}
if [[ ! -x $venv/bin/lizard ]]; then
  echo "check-functions: installing lizard $version into $venv" >&2
  rm -rf "$venv"
  if ! mkdir -p "$(dirname "$venv")" || ! /usr/bin/python3 -m venv "$venv" >&2 ||
     ! "$venv/bin/pip" install --no-cache-dir --progress-bar off -q "lizard==$version" >&2; then
    rm -rf "$venv"
    echo "error: check-functions: could not install lizard $version from PyPI into $venv" >&2
    exit 2
  fi
fi
# -C: cyclomatic complexity is not checked (a high bar, so that length alone warns).
if ! out=$("$venv/bin/lizard" -l cpp -L "$max_lines" -C 1000 -w app common data models trainer tools fuzz); then
  echo "$out" | sed -E 's/^([^:]+:[0-9]+): warning: ([^ ]+) has .* ([0-9]+) length.*/\1: \2 is \3 lines/'
  echo "error: $(echo "$out" | grep -c warning) function(s) over $max_lines lines: name their parts" \
       "(docs/ARCHITECTURE.md, \"Function length\")"
  exit 1
fi
exit $status
