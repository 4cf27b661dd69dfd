#!/usr/bin/env bash
# The GPU proof in one window of a GPU host: two calls of at most 600 s each, one after the other on the
# same machine, each bringing back at most 8 files (docs/BENCHMARKS.md "One window on a GPU host").
#
#   part  phases of scripts/gpu-check.sh          usual time on an H200 (not yet measured on a GPU in this
#                                                 form: estimates from the phases' earlier times)
#   1     env tests speed cap llama               about 8.5 min: versions, the CUDA tests; both models
#                                                 against Python by wall time, at least 3 s of steps a
#                                                 side, 2 rounds, the trainer also with cuda_graph off
#                                                 (about 220 s); the cut, backoff and grow-back of the
#                                                 default cuDNN policy with CUDA graphs on, the default
#                                                 auto search and its check first (budget 120 s); the
#                                                 Llama-family row against transformers, one round
#                                                 (about 100 s, transformers from the bundle's wheels)
#   2     profile jpeg fixes compile summary      about 6 min: the profile tables, ResNet-50 from packed
#                                                 JPEGs against synthetic batches, the input path off and
#                                                 on (the fixes phase's `input` pairs only, about 50 s),
#                                                 then torch.compile as a second reference if the deadline
#                                                 leaves room (each model under TRAINER_COMPILE_TIMEOUT_S,
#                                                 120 s); `share` and the other fixes run only when listed
#
# Without torch.compile the two parts take about 11.5 min of device time, so that with the machine's start
# they fit a 15-minute window; torch.compile comes last and runs only where the deadline leaves it room:
# give part 2 the window's time that is left, TRAINER_GPU_DEADLINE_S=<seconds left less 30>.
#
# Everything is written to WORK (default /tmp/trainer-window), outside PACK, and kept there between the
# two calls; after each phase PACK gets that phase's small files as <phase>.tgz (no checkpoints, no
# datasets), the profiler's traces as traces_<job>.tar, and summary.json rewritten from all that WORK
# holds. A call cut short still brings back every phase it finished. A phase that would end past
# TRAINER_GPU_DEADLINE_S (default 540) seconds is skipped and listed in the summary.
#
# Usage: scripts/gpu-window.sh PACK 1|2|all|PHASE,PHASE,... [WORK]
# (a list of phases instead of a part: a window that measures again only what changed, e.g.
# env,tests,speed,profile then share,fixes,summary; `summary` gathers what WORK holds from both calls)
# On the host (the bundle carried in .gpu-run/bundle, scripts/bundle-gpu.sh):
#   bash scripts/gpu-window.sh "$OUT" 1     then, at once,     bash scripts/gpu-window.sh "$OUT" 2
# Here, without a GPU, the same parts run in CPU mode on small jobs: the rehearsal (same packing, same
# count of files). Exit codes: those of scripts/gpu-check.sh (1: a phase failed; 2: a usage error).
set -uo pipefail
cd "$(dirname "$0")/.."
(($# >= 2)) || { echo "usage: scripts/gpu-window.sh PACK 1|2|all|PHASE,PHASE,... [WORK]" >&2; exit 2; }
pack=$1 part=$2 work=${3:-/tmp/trainer-window}
case $part in
  1) phases=(env tests speed cap llama) ;;
  2) phases=(profile jpeg fixes compile summary)
     export TRAINER_FIXES_ONLY=${TRAINER_FIXES_ONLY:-resnet50_input,gpt2_input} ;;
  all) phases=(env tests speed cap llama profile jpeg compile share fixes summary) ;;
  *[a-z]*) IFS=, read -ra phases <<<"$part" ;;  # gpu-check.sh refuses a phase it does not know
  *) echo "error: part '$part': 1, 2, all or a list of phases" >&2; exit 2 ;;
esac
mkdir -p "$pack" "$work" || exit 2
[[ $(cd "$pack" && pwd) != "$(cd "$work" && pwd)"* ]] || { echo "error: WORK must be outside PACK" >&2; exit 2; }
export TRAINER_GPU_PACK=$pack TRAINER_GPU_DEADLINE_S=${TRAINER_GPU_DEADLINE_S:-540}
export TRAINER_CAP_BUDGET_S=${TRAINER_CAP_BUDGET_S:-120} TRAINER_SPEED_ROUNDS=${TRAINER_SPEED_ROUNDS:-2}
scripts/gpu-check.sh "$work" "${phases[@]}"
rc=$?
echo "== gpu-window: part $part: $(ls "$pack" | wc -l) files in $pack: $(ls "$pack" | tr '\n' ' ')"
exit $rc
