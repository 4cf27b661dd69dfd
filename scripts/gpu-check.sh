#!/usr/bin/env bash
# The GPU proof in a few calls: every phase writes its logs and JSON under OUTDIR, and
# `summary` gathers the figures into OUTDIR/summary.json. TRAINER_SPEED_ROUNDS: the speed phase's rounds
# (default 3). On a host without a GPU (no working
# `nvidia-smi -L`) the same phases run in CPU mode on small jobs, so that everything but the CUDA parts
# is exercised before device time is spent.
#
#   phase    what it runs                                                    CUDA job             CPU mode
#   env      versions: nvidia-smi, the host's torch, the trainer, the        -                    -
#            Python modules the later phases import (yaml, PIL, ...)
#   tests    the CUDA-only tests (GradScaler with planted inf/nan, fused     on the device        they skip,
#            unscale against the plain path, checkpointing with dropout,                          each with
#            the retried step's CUDA RNG) and the in-process step tests                           its reason
#   profile  a few steady steps of each model under the profiler on both     ResNet-50 fp16       ResNet-18,
#            sides (trainer bench --profile, bench/reference.py --profile)  channels_last 256;   gpt_tiny
#            and bench/profile_table.py's side-by-side table, the jobs as   GPT-2 small bf16
#            they are; the traces gzipped                                   context 1024
#   fixes    bench/ab.py, each candidate fix off and on, trainer alone:      as profile           as profile
#            the batched snapshot, the fused optimizer, the padded
#            vocabulary, the fused bias, the fused loss
#            (TRAINER_FIXES_ROUNDS, default 1; TRAINER_FIXES_ONLY=gpt2_fused_loss,...
#            runs only the pairs named)
#   cap      bench/cap_check.py: a cap cut through control.yaml mid-run      ResNet-50 224 fp16   plain CNN
#            (backoff, grow-back: recovery and grow-back step times) per     channels_last,       28x28,
#            cuDNN policy, each in a fresh process, side by side; auto       batch 256            batch 16
#            (curve) against the doubling search and pinned runs; the OOM
#            memory report read back; ends within TRAINER_CAP_BUDGET_S
#   speed    bench/compare.py, trainer against Python PyTorch on the same    ResNet-50 fp16 256;  ResNet-18,
#            device, alternating rounds, every figure by wall time over     GPT-2 small bf16,    gpt_tiny
#            the timed steps (at least 3 s a side, the steps calibrated):   context 1024
#            ratio, samples or tokens/s, MFU; the trainer again with
#            train.cuda_graph=off (the graph's gain, the losses of both
#            runs compared); the first step's start after the model built
#   llama    bench/compare.py, the trainer against transformers'            SmolLM2-135M's       llama_tiny,
#            LlamaForCausalLM of the same shape (sdpa), by wall time, one    shape bf16, 16 x     4 x 64
#            round (TRAINER_LLAMA_ROUNDS) after the calibration; a Python    2048 tokens          tokens
#            without transformers gets the bundle's wheels (py-wheels.py)
#   compile  bench/reference.py --compile: torch.compile as a second         as speed             skipped (the
#            reference, its compile time and steady speed, at the speed                          JSON says why)
#            phase's steps (run after it; skipped past the deadline)
#   jpeg     a JPEG folder (bench/make_jpeg_folder.py), packed by trainer   ResNet-50 224 bf16,  ResNet-18 64,
#            convert-images, then trained from the packed file with the      batch 256, 2048      batch 8, 64
#            host's cores against the same job on synthetic data: speed       JPEGs                JPEGs
#            ratio, the loader's share of the step, the CPU cores used
#   share    bench/share_gpu.py: two jobs with memory.limit auto on one      ResNet-50 fp16,      plain CNN
#            device; no crash, no lost step, each one's micro-batch, cap     global 4096 and 1024
#            and samples/s alone and beside the other
#   summary  OUTDIR/summary.json: the figures above and the floors and goals ("floors": ResNet-50
#            trainer/eager >= 1.05x, goal 1.15x; GPT-2 MFU by wall time >= 40%, goal 45%; GPT-2
#            trainer/eager >= 1.1x; OOM to the completed step, graphs on, <= 1 s, goal 0.3 s; micro_batch
#            auto under the cut cap <= 8 s and the largest that fits or a faster one; the first step <= 2 s
#            after the model is built), each marked met or missed (null in CPU mode); the Llama row
#            (speed_llama) beside them, a figure without a floor
#
# TRAINER_GPU_PACK and TRAINER_GPU_DEADLINE_S (below): the packing and the deadline of one window
# (scripts/gpu-window.sh).
#
# Usage: scripts/gpu-check.sh OUTDIR [PHASE ...]   (default: env tests profile cap speed jpeg summary; fixes,
# share, llama and compile run when named)
# Wall times on an H200 (docs/BENCHMARKS.md; 2026-11-27 unless said): env 4-6 s, tests 48-50 s (67 tests, H100 and H200), share
# 211 s (A's 150 steps), speed 103-120 s with TRAINER_SPEED_ROUNDS=2 before the calibrated steps and the
# cuda_graph=off arm (now about 220 s: not yet measured on a GPU), compile not yet measured on a GPU (about
# 200 s expected), profile 46-54 s, fixes 241 s (5 pairs,
# TRAINER_FIXES_ROUNDS=2; 27 s for the fused loss's pair alone), jpeg 42-62 s (2026-11-26); cap: its
# budget, TRAINER_CAP_BUDGET_S (default 200 s on a GPU; stages that would not end in time are skipped and
# listed).
#
# The binaries: TRAINER_BUNDLE (default .gpu-run/bundle, made by scripts/bundle-gpu.sh, unpacked from
# its .tar.xz) when it has a `run`; else TRAINER_BUILD (default build-cuda, else build). The Python for the references:
# TRAINER_PYTHON, else the bundle's rule (/opt/torch/.venv/bin/python3, python3), else the 2.11
# environment (scripts/install-torch.sh --python) for build-cuda and /usr/bin/python3 for build.
# TRAINER_GPU_CHECK_MODE=cuda|cpu overrides the detection. Exit 1 if a phase failed (the others still
# run); a missed speed target is a figure, not a failure. Exit 2: a usage error, an unknown phase, or no
# trainer found.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
(($# >= 1)) || { echo "usage: scripts/gpu-check.sh OUTDIR [env|tests|profile|cap|speed|llama|compile|jpeg|fixes|share|summary ...]" >&2; exit 2; }
out=$1
shift
phases=("$@")
((${#phases[@]})) || phases=(env tests profile cap speed jpeg summary)
for p in "${phases[@]}"; do
  case $p in
    env | tests | profile | cap | speed | llama | compile | jpeg | fixes | share | summary) ;;
    *) echo "error: unknown phase '$p' (env, tests, profile, cap, speed, llama, compile, jpeg, fixes, share, summary)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)

mode=${TRAINER_GPU_CHECK_MODE:-}
[[ -n $mode ]] || { nvidia-smi -L >/dev/null 2>&1 && mode=cuda || mode=cpu; }

bundle=${TRAINER_BUNDLE:-.gpu-run/bundle}
# The bundle travels to a host as <bundle>.tar.xz (scripts/bundle-gpu.sh): unpacked beside it, with the
# host's Python (a host may have no xz), when the folder is missing or older than the archive.
if [[ -f $bundle.tar.xz && (! -f $bundle/STAMP || $bundle.tar.xz -nt $bundle/STAMP) ]]; then
  unpack=${TRAINER_PYTHON:-}
  [[ -z $unpack && -x /opt/torch/.venv/bin/python3 ]] && unpack=/opt/torch/.venv/bin/python3
  "${unpack:-python3}" - "$bundle.tar.xz" "$bundle" <<'PY' || { echo "error: could not unpack $bundle.tar.xz" >&2; exit 2; }
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    t.extractall(sys.argv[2], **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
PY
  touch "$bundle/STAMP"
  echo "== gpu-check: unpacked $bundle.tar.xz: $(head -n 1 "$bundle/STAMP")"
fi
if [[ -x $bundle/run ]]; then
  bundle=$(cd "$bundle" && pwd)
  trainer=("$bundle/run" trainer)
  tests=("$bundle/run" trainer_tests)
  py=${TRAINER_PYTHON:-}
  [[ -z $py && -x /opt/torch/.venv/bin/python3 ]] && py=/opt/torch/.venv/bin/python3
  py=${py:-python3}
  # The bundle's wrapper imports torch to find its libraries, seconds per launch: once here for all.
  [[ -n ${TRAINER_TORCH_LIB:-} ]] ||
    TRAINER_TORCH_LIB=$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  export TRAINER_TORCH_LIB TRAINER_PYTHON=$py
else
  build=${TRAINER_BUILD:-}
  [[ -n $build ]] || { [[ -x build-cuda/trainer ]] && build=build-cuda || build=build; }
  [[ -x $build/trainer ]] || { echo "error: no trainer: build one (scripts/test.sh) or bundle one (scripts/bundle-gpu.sh)"; exit 2; }
  build=$(cd "$build" && pwd)
  trainer=("$build/trainer")
  tests=("$build/tests/trainer_tests")
  py=${TRAINER_PYTHON:-}
  if [[ -z $py ]]; then
    if [[ $build == */build-cuda ]]; then py=$(scripts/install-torch.sh --python); else py=/usr/bin/python3; fi
  fi
fi
# compare.py takes one executable.
mkdir -p "$out/bin"
{ echo '#!/usr/bin/env bash'; printf 'exec'; printf ' %q' "${trainer[@]}"; echo ' "$@"'; } >"$out/bin/trainer"
chmod +x "$out/bin/trainer"

# A window on a GPU host (scripts/gpu-window.sh): TRAINER_GPU_PACK=DIR packs each phase's small files
# into DIR/<phase>.tgz as soon as it ends (its profiler traces into DIR/traces_<job>.tar) and rewrites
# DIR/summary.json, so that a call cut short still brings back what it measured; OUTDIR, with its
# checkpoints, datasets and traces, stays outside DIR. TRAINER_GPU_DEADLINE_S: a phase that would not end
# within that many seconds of the start (by its usual time on a GPU, below) is skipped and listed.
pack=${TRAINER_GPU_PACK:-}
deadline=${TRAINER_GPU_DEADLINE_S:-0}
[[ -z $pack ]] || { mkdir -p "$pack" && pack=$(cd "$pack" && pwd); } || exit 2
# speed: per model a calibration pair and TRAINER_SPEED_ROUNDS rounds of three runs (trainer, Python, the
# trainer with cuda_graph off), each about 11 s of start and cuDNN timing plus 3.5 s of steps; compile:
# torch.compile's first steps (about a minute a model) and the timed ones, each model under a timeout.
declare -A usual_s=([env]=15 [tests]=60 [profile]=100 [cap]=$((${TRAINER_CAP_BUDGET_S:-200} + 15))
  [speed]=$((60 + 90 * ${TRAINER_SPEED_ROUNDS:-2})) [compile]=$((2 * ${TRAINER_COMPILE_TIMEOUT_S:-120} + 20))
  [jpeg]=70 [fixes]=$((120 * ${TRAINER_FIXES_ROUNDS:-1} + 10)) [share]=220 [summary]=5
  [llama]=$((30 + 35 * (${TRAINER_LLAMA_ROUNDS:-1} + 1))))
# A pair of runs takes about 25 s a round on a GPU (5 pairs: 241 s with 2 rounds).
[[ -z ${TRAINER_FIXES_ONLY:-} ]] ||
  usual_s[fixes]=$((25 * $(tr ',' '\n' <<<"$TRAINER_FIXES_ONLY" | grep -c .) * ${TRAINER_FIXES_ROUNDS:-1} + 10))

failed=()
skipped=()
phase() {  # name, command...: runs it, logs to OUTDIR/<name>.log, records the wall time
  local name=$1 t0=$SECONDS rc
  shift
  if ((deadline > 0 && SECONDS + ${usual_s[$name]} > deadline)); then
    echo "== gpu-check ($mode): $name skipped: ${usual_s[$name]} s would end past the deadline (${deadline} s; $SECONDS s gone)"
    echo "{\"phase\": \"$name\", \"mode\": \"$mode\", \"rc\": null, \"skipped\": \"past the deadline\", \"wall_s\": 0}" >"$out/$name.phase.json"
    skipped+=("$name")
  else
    echo "== gpu-check ($mode): $name"
    "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "{\"phase\": \"$name\", \"mode\": \"$mode\", \"rc\": $rc, \"wall_s\": $((SECONDS - t0))}" >"$out/$name.phase.json"
    tail -n 3 "$out/$name.log"
    ((rc == 0)) || { failed+=("$name"); echo "== gpu-check: $name failed (exit $rc); see $out/$name.log"; }
  fi
  pack_phase "$name"
}

# The phase's own files (its name's prefix), without checkpoints, datasets and traces; the traces one
# archive per job (bench/profile_table.py's tables already hold their figures); then the summary again.
pack_phase() {
  local name=$1 stem
  [[ -n $pack ]] || return 0
  (cd "$out" && find . -path "./$name*" -type f ! -path '*/checkpoints/*' ! -path './jpeg_src/*' \
    ! -path './jpeg_packed/*' ! -name '*.trace.json.gz' -size -4000k | sort) >"$out/.pack.list"
  [[ -s $out/.pack.list ]] && tar -czf "$pack/$name.tgz" -C "$out" -T "$out/.pack.list"
  # TRAINER_GPU_TRACES=0: the traces stay in OUTDIR (a call that must bring back more phases than files)
  [[ ${TRAINER_GPU_TRACES:-1} == 0 ]] ||
  for stem in $(cd "$out" && ls "$name"_*.trace.json.gz 2>/dev/null | sed 's/\.[a-z]*\.trace\.json\.gz$//' | sort -u); do
    tar -cf "$pack/traces_${stem#"${name}_"}.tar" -C "$out" $(cd "$out" && ls "$stem".*.trace.json.gz)
  done
  [[ $name == summary ]] || summary_phase >"$out/.summary.log" 2>&1
  [[ -f $out/summary.json ]] && cp "$out/summary.json" "$pack/summary.json"
  return 0
}

env_phase() {
  date -u
  uname -srm
  nvidia-smi || echo "nvidia-smi: none (CPU mode)"
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
"device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'
  # What the later phases import: a module missing on the host shows here, in seconds, not in their logs.
  "$py" - <<'PY'
import importlib
for name, needed_by in (("yaml", "bench/reference.py: speed, profile, llama, compile"), ("PIL", "jpeg"),
                        ("torchvision", "reference.py's ResNets; without it, its own copy"),
                        ("transformers", "llama; without it, the bundle's wheels")):
    try:
        version = getattr(importlib.import_module(name), "__version__", "?")
    except ImportError:
        version = "missing"
    print(f"python: {name} {version} ({needed_by})")
PY
  "${trainer[@]}" --version
  [[ ${trainer[0]} != */run ]] || cat "$(dirname "${trainer[0]}")/STAMP"
}

# The CUDA-only tests skip on the CPU, each saying why; the in-process step tests run either way.
tests_phase() {
  "${tests[@]}" --gtest_output="json:$out/tests.json" \
    --gtest_filter='GradScaler*:GradScalerKernels*:ActivationCheckpoint*:StepSnapshot*:StepInProcess*:*Cuda*:TrainOptimizer*:GpuCap*:MemoryBackendFactory*'
}

cap_phase() {
  # Each cuDNN policy in a process of its own (cuDNN keeps a shape's algorithm for the process), stages in
  # order of importance until the budget: bench/cap_check.py. Its JSON holds the read-back memory report.
  local cfg=(--config configs/bench_resnet50_gpu.yaml --set amp.dtype=fp16) budget=${TRAINER_CAP_BUDGET_S:-200}
  if [[ $mode != cuda ]]; then
    cfg=(--config configs/bench_oom_tiny.yaml)
    budget=${TRAINER_CAP_BUDGET_S:-150}
  fi
  rm -rf "$out/cap_runs"
  "$py" bench/cap_check.py --trainer "$out/bin/trainer" "${cfg[@]}" --mode "$mode" \
    --budget-s "$budget" --workdir "$out/cap_runs" --out "$out/cap.json"
}

# The jobs of the profile and fixes phases: name|trainer config and --set's (the speed phase's jobs), and
# their candidate fixes as key=value,... (the profile phase turns them on on both sides).
profile_jobs() {
  if [[ $mode == cuda ]]; then
    echo "resnet50|--config configs/bench_resnet50_gpu.yaml --set amp.dtype=fp16|optim.implementation=fused"
    echo "gpt2|--config configs/bench_gpt2_small_synthetic.yaml|optim.implementation=fused,model.vocab_multiple=64"
  else
    # Debian's 1.13 has no fused kernels: the CPU mode switches the multi-tensor update instead.
    # ResNet-18 on 32x32 samples: the CPU mode rehearses the machinery, its figures are not judged.
    echo "resnet50|--config configs/bench_resnet18_cpu.yaml --set train.threads=1 --set train.global_batch=8 --set data.shape=[3,32,32]|optim.implementation=foreach"
    echo "gpt2|--config configs/bench_gpt_tiny_cpu.yaml --set data.kind=synthetic --set data.train= --set train.threads=1 --set train.global_batch=4|optim.implementation=foreach,model.vocab_multiple=64"
  fi
}

# Both sides profiled over the same steady steps (after the warmup: cuDNN's autotuning done), then the
# table; the jobs as they are (the fixes phase measures each candidate fix off and on).
profile_phase() {
  local rc=0 warmup=10 steps=3 name job fixes sets t p
  [[ $mode == cuda ]] || { warmup=1 steps=2; }
  while IFS='|' read -r name job fixes; do
    # shellcheck disable=SC2206
    sets=($job)
    t=$out/profile_$name.trainer.trace.json p=$out/profile_$name.python.trace.json
    echo "-- $name: ${sets[*]}"
    "${trainer[@]}" bench "${sets[@]}" --warmup $warmup --steps $steps --profile "$t" \
      --out "$out/profile_$name.trainer.json" || { rc=1; continue; }
    "$py" bench/reference.py "${sets[@]}" --warmup $warmup --steps $steps --profile "$p" \
      --out "$out/profile_$name.python.json" || { rc=1; continue; }
    "$py" bench/profile_table.py --trainer "$t" --python "$p" --title "$name (${sets[*]})" \
      --out-md "$out/profile_$name.md" --out-json "$out/profile_$name.json" || { rc=1; continue; }
    head -n 30 "$out/profile_$name.md"
    gzip -f "$t" "$p"
  done < <(profile_jobs)
  return $rc
}

# Each candidate fix off (A: the default) and on (B), the trainer alone, in alternating rounds (bench/ab.py);
# the snapshot the other way round: B is the default (batched), A the earlier per-buffer copies.
fixes_phase() {
  # The optimizer's pair: on CUDA the multi-tensor update (the default before fused) against fused (auto
  # now); on the CPU auto (the plain loop) against foreach.
  local rc=0 warmup=10 steps=20 name job fixes kv optimizer_a=foreach
  [[ $mode == cuda ]] || { warmup=1 steps=2 optimizer_a=auto; }
  while IFS='|' read -r name job fixes; do
    # shellcheck disable=SC2206
    local sets=($job)
    local pairs=()
    # The input path (data.fetch_ahead, data.uint8_batches; `on` rather than auto so that the CPU mode
    # rehearses the same machinery): off, each micro-batch crosses as float32 on the compute stream inside
    # its step; on, the next step's uint8 batch crosses on a side stream while this step runs.
    pairs+=("input|data.fetch_ahead=off,data.uint8_batches=off|data.fetch_ahead=on,data.uint8_batches=on")
    [[ $name == resnet50 ]] && pairs+=("snapshot|train.snapshot=per_buffer|train.snapshot=batched")
    [[ $name == gpt2 ]] && pairs+=("fused_bias|model.fused_bias=false|model.fused_bias=true"
      "fused_loss|train.fused_loss=false|train.fused_loss=true")
    for kv in ${fixes//,/ }; do
      case ${kv%%=*} in
        optim.implementation) pairs+=("optimizer|optim.implementation=$optimizer_a|$kv") ;;
        model.vocab_multiple) pairs+=("vocab|model.vocab_multiple=1|$kv") ;;
      esac
    done
    for pair in "${pairs[@]}"; do
      IFS='|' read -r what a b <<<"$pair"
      # TRAINER_FIXES_ONLY=job_fix,...: only those pairs (a window that measures again only what changed)
      [[ -z ${TRAINER_FIXES_ONLY:-} || ,$TRAINER_FIXES_ONLY, == *",${name}_$what,"* ]] || continue
      "$py" bench/ab.py "${sets[@]}" --a "$a" --b "$b" --name "${name}_$what" \
        --rounds "${TRAINER_FIXES_ROUNDS:-1}" --warmup $warmup --steps $steps --trainer "$out/bin/trainer" \
        --workdir "$out/fixes_${name}_$what" --out "$out/fixes_${name}_$what.json" || rc=1
    done
  done < <(profile_jobs)
  return $rc
}

# Two jobs on one device, both with memory.limit: auto (bench/share_gpu.py): A takes most of it (a global
# batch whose micro-batch search fills its cap), B starts once A is training, with a batch that does not fit
# in what A left, and outlives A. Neither may crash or lose a step; B starts with what A leaves it, backs
# off or searches down, and grows back when A ends.
share_phase() {
  local cfg=(--config configs/bench_resnet50_gpu.yaml --set amp.dtype=fp16 --set train.micro_batch=auto
    --set checkpoint.final=false)
  # A's 150 steps (about 0.9 s each alone) outlast B's start (its search and cuDNN timing before its first
  # step: 30-67 s on an H200): the two train side by side for a minute or more, which the overlap figures
  # need (with 90 steps B's start could take all but a few seconds of A's rest).
  local a=(--a-set train.global_batch=4096) b=(--b-set train.global_batch=1024) steps=(--a-steps 150 --b-steps 120 --b-after 8)
  if [[ $mode != cuda ]]; then
    cfg=(--config configs/bench_oom_tiny.yaml --set train.micro_batch=auto --set train.threads=1 --set checkpoint.final=false)
    a=() b=() steps=(--a-steps 300 --b-steps 400 --b-after 50)
  fi
  rm -rf "$out/share_runs"
  "$py" bench/share_gpu.py --trainer "$out/bin/trainer" "${cfg[@]}" "${a[@]}" "${b[@]}" "${steps[@]}" \
    --timeout-s "${TRAINER_SHARE_TIMEOUT_S:-240}" --workdir "$out/share_runs" --out "$out/share.json"
}

# Trainer against Python on the speed jobs (the profile phase's), every figure by wall time over at least
# 3 s of timed steps a side (1 s in CPU mode; bench/compare.py calibrates the steps), and the trainer again with
# train.cuda_graph=off: the graph's gain and the losses of the same run with and without it. In CPU mode the
# default is off as well (the graph is CUDA's), so that arm rehearses the machinery; the summary records the
# comparison as skipped there.
speed_phase() {
  local rc=0 warmup=10 rounds=${TRAINER_SPEED_ROUNDS:-2} min_wall=${TRAINER_SPEED_MIN_WALL_S:-3} name job fixes
  # CPU mode: 1 s of timed steps a side (at least the 20 steps) is enough to rehearse the calibration.
  [[ $mode == cuda ]] || { warmup=2 rounds=2 min_wall=${TRAINER_SPEED_MIN_WALL_S:-1}; }
  while IFS='|' read -r name job fixes; do
    # shellcheck disable=SC2206
    local sets=($job)
    echo "-- $name: ${sets[*]}"
    "$py" bench/compare.py "${sets[@]}" --trainer "$out/bin/trainer" --python "$py" --rounds "$rounds" \
      --warmup $warmup --steps 20 --min-wall-s "$min_wall" --no-loader \
      --trainer-b-set train.cuda_graph=off --trainer-b-name cuda_graph_off \
      --workdir "$out/speed_$name" --out "$out/speed_$name.json" || rc=1
  done < <(profile_jobs)
  return $rc
}

# The Llama-family row: SmolLM2-135M's shape in bf16 against transformers' LlamaForCausalLM of the same
# shape (sdpa attention), by wall time, TRAINER_LLAMA_ROUNDS rounds (1) after compare.py's calibration pair,
# without the cuda_graph-off arm. A Python without transformers (the GPU host's) gets the bundle's wheels,
# unpacked beside it for this phase only (scripts/py-wheels.py); with neither, the row says why it is missing.
llama_phase() {
  local warmup=10 min_wall=${TRAINER_SPEED_MIN_WALL_S:-3} pypath=${PYTHONPATH:-} wheels=()
  local sets=(--config configs/bench_smollm2_135m_gpu.yaml)
  [[ $mode == cuda ]] || { warmup=2 min_wall=${TRAINER_SPEED_MIN_WALL_S:-1}
    sets+=(--set train.device=cpu --set model.name=llama_tiny --set model.context=64 --set train.global_batch=4
           --set amp.enabled=false --set train.threads=1); }
  [[ ${trainer[0]} != */run ]] || wheels=("$(dirname "${trainer[0]}")"/py/*.whl)
  if ! "$py" -c 'import transformers' 2>/dev/null && [[ -f ${wheels[0]:-} ]]; then
    "$py" scripts/py-wheels.py "$out/pylib" "${wheels[@]}" || return 1
    pypath=$out/pylib${pypath:+:$pypath}
  fi
  if ! PYTHONPATH=$pypath "$py" -c 'import transformers'; then
    echo "{\"skipped\": \"no transformers for $py, and no wheels in the bundle (scripts/bundle-gpu.sh carries them)\"}" \
      >"$out/llama_speed.json"
    return 0
  fi
  echo "-- llama: ${sets[*]}"
  PYTHONPATH=$pypath "$py" bench/compare.py "${sets[@]}" --trainer "$out/bin/trainer" --python "$py" \
    --rounds "${TRAINER_LLAMA_ROUNDS:-1}" --warmup $warmup --steps 20 --min-wall-s "$min_wall" --no-loader \
    --workdir "$out/llama_speed" --out "$out/llama_speed.json"
}

# torch.compile as a second reference, once per speed job at the speed phase's timed steps: its compile
# time (the first steps against the steady ones) and its steady speed, against the trainer's figure of the
# speed phase. Each model under TRAINER_COMPILE_TIMEOUT_S. CPU mode writes why it skips.
compile_phase() {
  local rc=0 warmup=5 name job fixes steps
  while IFS='|' read -r name job fixes; do
    # shellcheck disable=SC2206
    local sets=($job)
    if [[ $mode != cuda ]]; then
      echo "{\"skipped\": \"CPU mode: torch.compile is measured on a GPU only (its compile takes minutes on a CPU, and Debian's torch 1.13 has none)\"}" \
        >"$out/compile_$name.json"
      continue
    fi
    steps=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["steps"])' "$out/speed_$name.json" 2>/dev/null) ||
      steps=100
    echo "-- $name: ${sets[*]}, $steps timed steps"
    timeout "${TRAINER_COMPILE_TIMEOUT_S:-120}" "$py" bench/reference.py "${sets[@]}" --compile --warmup $warmup \
      --steps "$steps" --out "$out/compile_$name.json" || {
      echo "{\"skipped\": \"torch.compile did not finish within ${TRAINER_COMPILE_TIMEOUT_S:-120} s (or failed: compile.log)\"}" \
        >"$out/compile_$name.json"; rc=1; }
  done < <(profile_jobs)
  return $rc
}

# The packed JPEG path against synthetic data, same model, batch and precision. The JPEGs are made by
# TRAINER_JPEG_PROCS generator processes at once (different seeds), since one would take minutes. The CPU
# cores the run used: its user + system CPU seconds over its wall seconds (start-up included).
jpeg_phase() {
  local n=2048 procs=${TRAINER_JPEG_PROCS:-8} warmup=5 steps=20 i
  local common=(--set amp.dtype=bf16 --set memory.limit=none --set train.micro_batch=0)
  local packed_cfg=(--config configs/resnet50_imagefolder.yaml --set train.device=cuda --set model.num_classes=10)
  local synth_cfg=(--config configs/bench_resnet50_gpu.yaml --set model.num_classes=10)
  if [[ $mode != cuda ]]; then
    n=64 procs=2 warmup=1 steps=2
    common+=(--set model.name=resnet18 --set train.global_batch=8 --set amp.enabled=false --set train.threads=2)
    packed_cfg=(--config configs/resnet50_imagefolder.yaml --set train.device=cpu --set model.num_classes=10
      --set data.size=64)
    synth_cfg=(--config configs/bench_resnet50_gpu.yaml --set train.device=cpu --set model.num_classes=10
      --set 'data.shape=[3,64,64]')
  fi
  local jp=$out/jpeg_src pk=$out/jpeg_packed
  rm -rf "$jp" "$pk" "$out/jpeg_runs_"*
  for ((i = 0; i < procs; i++)); do
    "$py" bench/make_jpeg_folder.py --out "$jp/p$i" --count $((n / procs)) --seed "$i" >"$out/jpeg_make_$i.log" 2>&1 &
  done
  wait || true
  for ((i = 0; i < procs; i++)); do
    grep -q '^wrote' "$out/jpeg_make_$i.log" || { cat "$out/jpeg_make_$i.log"; return 1; }
    for d in "$jp/p$i"/train/*/; do
      mkdir -p "$jp/train/$(basename "$d")"
      for f in "$d"*.jpg; do mv "$f" "$jp/train/$(basename "$d")/p${i}_$(basename "$f")"; done
    done
    rm -rf "${jp:?}/p$i"
  done
  echo "jpegs: $(find "$jp/train" -name '*.jpg' | wc -l), $(du -sh "$jp" | cut -f1)"
  "${trainer[@]}" convert-images --src "$jp" --out "$pk" || return
  ls -l "$pk"
  local TIMEFORMAT='%R %U %S' t
  for kind in packed synthetic; do
    local cfg=("${packed_cfg[@]}" --set "data.train=$pk/train.h5" --set data.test=)
    [[ $kind == synthetic ]] && cfg=("${synth_cfg[@]}")
    { t=$( { time "${trainer[@]}" bench "${cfg[@]}" "${common[@]}" --warmup "$warmup" --steps "$steps" \
        --run-dir "$out/jpeg_runs_$kind" --out "$out/jpeg_$kind.json" >"$out/jpeg_$kind.out" 2>&1; } 2>&1 ); } || {
      cat "$out/jpeg_$kind.out"; return 1; }
    echo "$kind: $(tail -n 1 "$out/jpeg_$kind.out"); wall, user, sys s: $t"
    echo "$t" >"$out/jpeg_$kind.time"
  done
}

summary_phase() {
  "$py" - "$out" "$mode" <<'PY'
import json, os, sys
out, mode = sys.argv[1], sys.argv[2]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None
s = {"mode": mode, "phases": {}}
for f in sorted(os.listdir(out)):
    if f.endswith(".phase.json"):
        p = load(f)
        s["phases"][p["phase"]] = {"rc": p["rc"], "wall_s": p["wall_s"]} | (
            {"skipped": p["skipped"]} if p.get("skipped") else {})
t = load("tests.json")
if t:
    cases = [c for suite in t["testsuites"] for c in suite["testsuite"]]
    s["tests"] = {"run": len(cases),
                  "failed": [c["name"] for c in cases if c.get("failures")],
                  "skipped": [c["classname"] + "." + c["name"] for c in cases if c.get("result") == "SKIPPED"]}
c = load("cap.json")
if c:
    pol = ("recovery_s", "oom_step_time_s", "normal_step_s", "recovery_over_normal", "micro_batch_after",
           "grow_back_step_s_max", "throughput_ratio", "first_step_s", "step_before_cut_s", "tuned_sizes",
           "cuda_graph", "cuda_graph_start")
    s["cap"] = {"device": c.get("device"), "device_name": c.get("device_name"), "global_batch": c.get("global_batch"),
                "wall_s": c.get("wall_s"),
                "budget_s": c.get("budget_s"), "limits_bytes": c.get("calibration", {}).get("limits_bytes"),
                "cap_basis": c.get("calibration", {}).get("cap_basis"),
                "policies": {p: {k: v.get(k) for k in pol} for p, v in c.get("policies", {}).items()},
                "defaults": c.get("defaults"), "default_policy": (c.get("defaults") or {}).get("cudnn_policy"),
                "auto": {cap: {m: ({k: a[m].get(k) for k in ("micro_batch", "probes", "search_s", "ended",
                                                           "ooms_in_3_steps", "why", "faster", "auto_search")}
                                   if m in a else None)
                               for m in ("default", "curve", "doubling")} | {"verify": a.get("verify")}
                         for cap, a in c.get("auto", {}).items()},
                "targets": c.get("targets"), "skipped": [x["stage"] for x in c.get("skipped", [])],
                "failed": c.get("failed"), "report": c.get("report")}
jp, js = load("jpeg_packed.json"), load("jpeg_synthetic.json")
if jp and js:
    def cores(kind):
        wall, user, sys_ = (float(x) for x in open(os.path.join(out, "jpeg_%s.time" % kind)).read().split())
        return {"wall_s": wall, "cpu_s": user + sys_, "cores_used": (user + sys_) / wall}
    ratio = jp["samples_per_s_median"] / js["samples_per_s_median"]
    s["jpeg"] = {"model": jp["model"], "precision": jp["precision"], "global_batch": jp["global_batch"],
                 "device_name": jp.get("device_name", jp.get("env", {}).get("device_name")), "packed_samples_per_s": jp["samples_per_s_median"],
                 "synthetic_samples_per_s": js["samples_per_s_median"], "ratio": ratio,
                 "packed_data_wait_share": jp["data_wait_share"], "synthetic_data_wait_share": js["data_wait_share"],
                 "loader_workers": jp["loader_workers"], "packed_run": cores("packed"), "synthetic_run": cores("synthetic"),
                 "target": "packed JPEG images/s >= 0.9 x synthetic", "met": ratio >= 0.9 if mode == "cuda" else None,
                 "jpeg_sources": "synthetic" if "synthetic" in open(os.path.join(out, "jpeg_make_0.log")).read() else "photos"}
# Every speed figure by wall time over the timed steps on both sides (bench/compare.py's basis): samples/s,
# tokens/s, MFU and the ratio; the median step's figures beside them, named so.
cuda = mode == "cuda"
for f in ("speed_resnet50.json", "speed_gpt2.json", "llama_speed.json"):
    r = load(f)
    if not r:
        continue
    if r.get("skipped"):
        s["speed_llama"] = {"skipped": r["skipped"]}
        continue
    entry = {"model": r["model"], "precision": r["precision"], "global_batch": r["global_batch"],
             "device_name": r["device_name"], "driver": r.get("driver"), "versions": r["versions"],
             "date": r.get("date"), "basis": r.get("basis"), "timed_steps": r.get("steps"),
             "min_wall_s": r.get("min_wall_s"), "min_wall_met": r.get("min_wall_met"),
             "speed_ratio": r.get("speed_ratio"),
             "per_round_speed_ratio": [x.get("ratio_samples_per_s") for x in r["rounds"]],
             "speed_ratio_step_time": 1.0 / r["median_ratio_step_time_p50"],
             "trainer_samples_per_s": r.get("trainer_samples_per_s"),
             "python_samples_per_s": r.get("python_samples_per_s"),
             "trainer_tokens_per_s": r.get("trainer_tokens_per_s"),
             "python_tokens_per_s": r.get("python_tokens_per_s"),
             "trainer_mfu": r.get("trainer_mfu"), "python_mfu": r.get("python_mfu"),
             "trainer_mfu_median_step": r.get("trainer_mfu_median_step"),
             "trainer_samples_per_s_median_step": r.get("trainer_samples_per_s_median_step"),
             "padded_loss": r.get("padded_loss"), "first_step": r.get("first_step"),
             "commands": r.get("commands")}
    b = r.get("trainer_b")
    if b is not None:
        # The default (train.cuda_graph auto: on for CUDA in one process with the fused optimizer) against off.
        g = {k: b.get(k) for k in ("samples_per_s", "tokens_per_s", "mfu", "gain", "losses_equal",
                                   "losses_max_abs_diff", "skipped")}
        if not cuda:
            g["on_arm"] = "skipped: no CUDA device (auto is off on the CPU: both arms ran without a graph)"
        entry["cuda_graph_off"] = g
    c = load(f.replace("speed_", "compile_")) if f.startswith("speed_") else None
    if c is not None:
        if c.get("skipped"):
            entry["compile"] = {"skipped": c["skipped"]}
        else:
            cs = c.get("samples_per_s_aggregate")
            entry["compile"] = {"samples_per_s": cs, "tokens_per_s": c.get("tokens_per_s_aggregate"), "mfu": c.get("mfu"),
                                "compile_s": c.get("compile", {}).get("compile_s"),
                                "first_step_s": c.get("compile", {}).get("first_step_s"),
                                "timed_steps": c.get("timed_steps"), "wall_s": c.get("wall_s"),
                                "trainer_over_compiled": entry["trainer_samples_per_s"] / cs
                                if cs and entry["trainer_samples_per_s"] else None}
    s["speed_llama" if f.startswith("llama") else f.replace(".json", "")] = entry
# The input path's gain (the fixes phase's `input` pairs): the trainer alone, uint8 batches fetched ahead and
# copied on a side stream against float32 copied inside the step, by wall time.
for job in ("resnet50", "gpt2"):
    r = load("fixes_%s_input.json" % job)
    if r:
        s.setdefault("input_path", {})[job] = {
            k: r.get(k) for k in ("a", "b", "median_speedup_b", "median_speedup_b_step_p50", "basis", "device_name",
                                  "global_batch", "precision", "date")}
        s["input_path"][job]["per_round"] = [x.get("speedup_b") for x in r.get("rounds", [])]

# The floors and goals of the window (trainer and reference in one run on one GPU, by wall time); each
# judged on a CUDA host only: `met` and `goal_met` are null in CPU mode or where the figure is missing.
def figure(*path):
    v = s
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v
cap = s.get("cap", {})
default_policy = cap.get("default_policy") or "start"
auto_default = (cap.get("auto", {}).get("cut") or {}).get("default") or {}
floors = [
    ("ResNet-50 fp16 batch 256, samples/s, trainer / eager PyTorch", figure("speed_resnet50", "speed_ratio"),
     ">=", 1.05, 1.15, "x", "speed_resnet50.speed_ratio"),
    ("GPT-2 small bf16, MFU by wall time", figure("speed_gpt2", "trainer_mfu"), ">=", 0.40, 0.45, "fraction",
     "speed_gpt2.trainer_mfu"),
    ("GPT-2 small bf16, trainer / eager PyTorch with the fair reference", figure("speed_gpt2", "speed_ratio"),
     ">=", 1.1, None, "x", "speed_gpt2.speed_ratio"),
    ("OOM to the completed step, CUDA graphs on (the default), cuDNN policy " + default_policy,
     figure("cap", "policies", default_policy, "recovery_s"), "<=", 1.0, 0.3, "s",
     "cap.policies.%s.recovery_s" % default_policy),
    ("micro_batch auto, ResNet-50 under the cut cap: time to decide", auto_default.get("search_s"), "<=", 8.0, None,
     "s", "cap.auto.cut.default.search_s"),
    ("first step after the model is built (ResNet-50, to the step's start)",
     figure("speed_resnet50", "first_step", "since_model_built_s"), "<=", 2.0, None, "s",
     "speed_resnet50.first_step.since_model_built_s"),
]
def judged(v, op, bar):
    if v is None or not cuda or bar is None:
        return None
    return v >= bar if op == ">=" else v <= bar
s["floors"] = []
for what, v, op, floor, goal, unit, source in floors:
    e = {"figure": what, "value": v, "unit": unit, "floor": op + " " + str(floor),
         "goal": op + " " + str(goal) if goal is not None else None, "met": judged(v, op, floor),
         "goal_met": judged(v, op, goal), "from": source}
    if source.startswith("cap.auto"):
        # ... and the largest micro-batch that fits, or a faster one (the search says why it chose).
        largest = (cap.get("auto", {}).get("cut") or {}).get("verify", {}).get("largest_fitting_micro_batch")
        chosen = auto_default.get("micro_batch")
        e["micro_batch"], e["largest_fitting_micro_batch"] = chosen, largest
        e["why"] = auto_default.get("why")
        if e["met"] is not None:
            e["met"] = e["met"] and chosen is not None and largest is not None and (
                chosen >= largest or bool(auto_default.get("faster")))
    if source.startswith("speed_resnet50.first"):
        e["first_step_time_s"] = figure("speed_resnet50", "first_step", "first_step_time_s")
    if not cuda:
        e["note"] = "CPU mode: not judged (small jobs on a CPU)"
    s["floors"].append(e)
sh = load("share.json")
if sh:
    s["share"] = sh
skipped = [p for p, v in s["phases"].items() if v.get("skipped")]
if skipped:
    s["skipped_phases"] = skipped
json.dump(s, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(s, indent=1)[:4000])
PY
}

for p in "${phases[@]}"; do phase "$p" "${p}_phase"; done
((${#skipped[@]} == 0)) || echo "== gpu-check: skipped (past the deadline): ${skipped[*]}"
((${#failed[@]} == 0)) || { echo "== gpu-check: failed: ${failed[*]}"; exit 1; }
echo "== gpu-check ($mode): every phase passed; $out/summary.json"
