#!/usr/bin/env bash
# CI leg `container` (scripts/test.sh): builds deploy/Dockerfile as a user would, runs the image, stops
# and resumes a job in it, and validates the Kubernetes manifests. Needs root, buildah, podman and
# debootstrap (scripts/install-deps.sh --container), and Debian's mirror and PyPI.
#
#   1. base    `debootstrap --variant=minbase bookworm` from the mirror apt uses, imported as the local
#              image debian:bookworm (no registry is asked; made once, reused while it exists)
#   2. build   buildah bud --isolation chroot -f deploy/Dockerfile -t localhost/trainer:2.11-cu130 .
#              (the wheelhouse and ccache are the Dockerfile's cache mounts, kept under
#              ~/.cache/trainer/container/tmp/buildah-cache: a rerun fetches only the index pages and
#              compiles only what changed; no intermediate layer is committed, --layers=false)
#   3. run     in the image, the run folder mounted from the host: `trainer --version` says LibTorch
#              2.11 with CUDA; a job on synthetic data stopped with SIGTERM exits 143 with a checkpoint
#              while a third container, started on the same folder with --wait-for-run-dir before the
#              stop (the Kubernetes replacement pod), waits for it, resumes from that checkpoint and ends
#              with the weights of an uninterrupted run (model.pt and optimizer.pt equal byte for byte)
#              and every step once, in order, in metrics.jsonl; /healthz and /metrics answer from the
#              host while it trains
#   4. k8s     deploy/k8s-*.yaml against the Kubernetes schemas (kubernetes-validate --strict, from PyPI
#              in a virtual environment under ~/.cache/trainer/), the PyTorchJob's pod templates as
#              PodTemplates; the image, port and probe paths agree with the Dockerfile; the
#              replacement pod's --wait-for-run-dir exceeds the grace period
#
# Why `--isolation chroot`: podman's OCI runtimes (crun, runc) cannot start a container without creating
# cgroups, and the CI machines' hybrid cgroup v1 tree must not be changed. Chroot isolation creates no
# cgroup, builds and runs the same image, and shares the host's network (so the endpoint is reached on
# localhost). It cannot limit memory: `docker update --memory` is not exercised here (the cgroup files
# the trainer reads are faked in tests/test_container_memory.cpp).
#
# Usage: scripts/container-test.sh [base|build|run|k8s]... (default: all four, in order).
# TRAINER_IMAGE names the image (default localhost/trainer:2.11-cu130); TRAINER_CONTAINER_PORT the host
# port of the endpoint during the run (default 8080, the image's documented port).
set -euo pipefail
cd "$(dirname "$0")/.."

cache=${XDG_CACHE_HOME:-$HOME/.cache}/trainer
image=${TRAINER_IMAGE:-localhost/trainer:2.11-cu130}
port=${TRAINER_CONTAINER_PORT:-8080}
# buildah keeps RUN --mount=type=cache folders under $TMPDIR/buildah-cache: a host folder that survives.
export TMPDIR=$cache/container/tmp
mkdir -p "$TMPDIR"
phases=("$@")
((${#phases[@]})) || phases=(base build run k8s)

fail() { echo "error: container: $*" >&2; exit 1; }
for tool in buildah podman debootstrap curl; do
  command -v $tool >/dev/null || fail "$tool is missing (scripts/install-deps.sh --container)"
done

base() {
  if buildah inspect --type image localhost/debian:bookworm >/dev/null 2>&1; then
    echo "base: localhost/debian:bookworm exists"
    return
  fi
  # The Debian mirror apt already uses (one-line or deb822 sources), not the security archive.
  local mirror
  mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
    grep -v '^ *#' | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -1 | tr -d ' ' || true)
  mirror=${TRAINER_DEBIAN_MIRROR:-${mirror:-http://deb.debian.org/debian}}
  local root=$cache/container/rootfs-bookworm
  rm -rf "$root"
  echo "base: debootstrap --variant=minbase bookworm from $mirror"
  debootstrap --variant=minbase bookworm "$root" "$mirror" >"$cache/container/debootstrap.log" 2>&1 ||
    { tail -20 "$cache/container/debootstrap.log"; fail "debootstrap failed"; }
  cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
EOF
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" --numeric-owner -cf - . | podman import --change 'CMD ["bash"]' - localhost/debian:bookworm >/dev/null
  # FROM debian:bookworm resolves a short name: the local image answers under both names.
  podman tag localhost/debian:bookworm docker.io/library/debian:bookworm
  rm -rf "$root"
  echo "base: localhost/debian:bookworm ($(podman image inspect --format '{{.Size}}' localhost/debian:bookworm) bytes)"
}

build() {
  # pip inside the build trusts what pip trusts here (a proxy that re-signs TLS has its CA in this bundle).
  local ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
  local old
  old=$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
  # --layers=false: no image is committed after each instruction, only the result. Committing the build
  # stage's 7 GB virtual environment, its staged libraries and their copy into the runtime stage took 230 s
  # of a 606 s cold build on 2 cores (431 s without). A rerun still finds the wheels and the compiled
  # units in the cache mounts; the image is the same.
  buildah bud --isolation chroot --pull-never --layers=false --force-rm --secret "id=pip-ca,src=$ca" \
    -f deploy/Dockerfile -t "$image" . >"$cache/container/build.log" 2>&1 ||
    { tail -40 "$cache/container/build.log"; fail "buildah bud failed (log: $cache/container/build.log)"; }
  # The image this build replaced goes.
  local new
  new=$(podman image inspect --format '{{.Id}}' "$image")
  [[ -n $old && $old != "$new" ]] && podman rmi "$old" >/dev/null 2>&1 || true
  echo "build: $image, $(podman image inspect --format '{{.Size}}' "$image") bytes"
}

# ---- run ---------------------------------------------------------------------------------------------
containers=()
ctr=""
cleanup() {
  local c
  for c in "${containers[@]}"; do buildah rm "$c" >/dev/null 2>&1 || true; done
}
new_container() {  # like `docker create`: a fresh container of the image, named in $ctr
  ctr=$(buildah from --pull-never "$image")
  containers+=("$ctr")
  # buildah (1.28) mounts the image's VOLUME /runs over a -v at the same path; Docker lets the -v
  # replace it. Dropping the declaration from this container gives Docker's behaviour.
  buildah config --volume /runs- "$ctr"
}
# Like `docker run -v $runs:/runs <image> ARGS`: the image's user (trainer, uid 1000) and working folder.
run_in() {
  local c=$1
  shift
  buildah run --isolation chroot -v "$runs:/runs" "$c" -- "$@"
}
descendant_named() {  # pid name: the first descendant of pid whose command is name
  local pid=$1 name=$2 child
  for child in $(cat /proc/"$pid"/task/*/children 2>/dev/null); do
    if [[ $(cat /proc/"$child"/comm 2>/dev/null) == "$name" ]]; then echo "$child"; return 0; fi
    descendant_named "$child" "$name" && return 0
  done
  return 1
}
metric() {  # name: its value in /metrics, empty when the endpoint does not answer
  { curl -fsS --max-time 2 "localhost:$port/metrics" 2>/dev/null || true; } | awk -v m="$1" '$1 == m {print $2}'
}

run() {
  trap cleanup EXIT
  runs=$cache/container/runs
  rm -rf "$runs"
  mkdir -p "$runs"
  chown 1000:1000 "$runs"   # the image's user writes the run folder
  if curl -s --max-time 1 "localhost:$port/" >/dev/null 2>&1; then
    fail "port $port is taken on this host (TRAINER_CONTAINER_PORT picks another)"
  fi

  local c1 version
  new_container
  c1=$ctr
  version=$(run_in "$c1" trainer --version)
  echo "run: trainer --version: $version"
  [[ $version =~ LibTorch\ 2\.11\.[0-9]+\ with\ CUDA\ 13\. ]] || fail "expected LibTorch 2.11 with CUDA 13, got '$version'"

  # A small job on synthetic data (one thread, one worker: the same on every host), long enough to be
  # stopped in the middle.
  local steps=1500
  local job=(trainer --config /opt/trainer/configs/bench_oom_tiny.yaml --set train.steps=$steps
             --set log.level=info)
  echo "run: the uninterrupted job ($steps steps)"
  run_in "$c1" "${job[@]}" --run-dir /runs/full >"$runs/full.out" 2>&1 ||
    { tail -20 "$runs/full.out"; fail "the uninterrupted job failed"; }

  echo "run: the same job in a second container, endpoint on port $port, stopped with SIGTERM"
  local c2 pid tpid step="" health
  new_container
  c2=$ctr
  run_in "$c2" "${job[@]}" --run-dir /runs/stopped --set log.http_port=$port --set log.http_host=0.0.0.0 \
    >"$runs/stopped.out" 2>&1 &
  pid=$!
  for _ in $(seq 600); do   # up to 60 s for setup and 100 steps
    step=$(metric trainer_step)
    [[ -n $step && $step -ge 100 ]] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
  done
  [[ -n $step && $step -ge 100 ]] || { tail -20 "$runs/stopped.out"; fail "no trainer_step >= 100 in /metrics"; }
  health=$(curl -fsS --max-time 2 "localhost:$port/healthz") || fail "/healthz did not answer 200"
  echo "run: /metrics trainer_step $step; /healthz: $health"
  # The Kubernetes replacement pod: a third container on the same folder is already up, waiting for the
  # run folder (--wait-for-run-dir), when the second is told to stop; it must wait for the SIGTERM save,
  # then resume from it.
  echo "run: a third container on the same folder waits for it (--wait-for-run-dir 120)"
  local c3 pid3 waiting=""
  new_container
  c3=$ctr
  run_in "$c3" "${job[@]}" --run-dir /runs/stopped --wait-for-run-dir 120 >"$runs/resumed.out" 2>&1 &
  pid3=$!
  for _ in $(seq 600); do   # up to 60 s for the container to start and say it waits
    waiting=$(grep -m1 'waiting for pid' "$runs/resumed.out" || true)
    [[ -n $waiting ]] && break
    kill -0 $pid3 2>/dev/null || break
    sleep 0.1
  done
  [[ -n $waiting ]] || { tail -20 "$runs/resumed.out"; fail "the third container did not wait for the run folder"; }
  echo "run: ${waiting#*] }"
  # What `docker stop` does: the image's STOPSIGNAL (SIGTERM) to the container's process.
  tpid=$(descendant_named $pid trainer) || fail "no trainer process under the container"
  kill -TERM "$tpid"
  local rc=0
  wait $pid || rc=$?
  [[ $rc -eq 143 ]] || { tail -20 "$runs/stopped.out"; fail "the stopped job exited $rc, expected 143"; }
  local saved
  saved=$(cat "$runs/stopped/checkpoints/latest" 2>/dev/null) || fail "no checkpoint after SIGTERM"
  echo "run: exit 143, checkpoint $saved"
  [[ $saved < $(printf 'step-%08d' $steps) ]] || fail "the job finished before the SIGTERM ($saved)"
  rc=0
  wait $pid3 || rc=$?
  [[ $rc -eq 0 ]] || { tail -20 "$runs/resumed.out"; fail "the waiting job exited $rc, expected 0"; }
  grep -q "resum" "$runs/resumed.out" || { tail -20 "$runs/resumed.out"; fail "the waiting job did not resume"; }
  local last f
  last=$(printf 'step-%08d' $steps)
  for f in model.pt optimizer.pt; do
    cmp "$runs/full/checkpoints/$last/$f" "$runs/stopped/checkpoints/$last/$f" ||
      fail "$f of the resumed run differs from the uninterrupted run's"
  done
  # Every step once, in order: no line of one container between the other's.
  /usr/bin/python3 - "$runs/stopped/metrics.jsonl" "$steps" <<'EOF' || fail "metrics.jsonl does not hold every step once, in order"
import json, sys
steps = [json.loads(l)["step"] for l in open(sys.argv[1]) if l.strip() and "event" not in json.loads(l)]
if steps != list(range(1, int(sys.argv[2]) + 1)):
    sys.exit(f"{sys.argv[1]}: {len(steps)} step lines, first out of order at index "
             f"{next((i for i, s in enumerate(steps) if s != i + 1), len(steps))}")
EOF
  echo "run: resumed from $saved to $last after waiting; model.pt and optimizer.pt equal the uninterrupted run's byte for byte; every step once in metrics.jsonl"
  cleanup
  containers=()
}

# ---- k8s ---------------------------------------------------------------------------------------------
k8s() {
  local venv=$cache/kubernetes-validate-1.37.0
  if [[ ! -x $venv/bin/kubernetes-validate ]]; then
    rm -rf "$venv"
    /usr/bin/python3 -m venv "$venv"
    "$venv/bin/pip" install -q --progress-bar off kubernetes-validate==1.37.0
  fi
  local tmp
  tmp=$(mktemp -d)
  # kubernetes-validate has no schema for the Kubeflow PyTorchJob (a custom resource): its pod templates
  # are checked as core/v1 PodTemplates.
  "$venv/bin/python" - deploy/k8s-pytorchjob.yaml "$tmp" <<'EOF'
import sys, yaml
for doc in yaml.safe_load_all(open(sys.argv[1])):
    if doc and doc.get("kind") == "PyTorchJob":
        for role, spec in doc["spec"]["pytorchReplicaSpecs"].items():
            pt = {"apiVersion": "v1", "kind": "PodTemplate",
                  "metadata": {"name": f"{doc['metadata']['name']}-{role.lower()}"}, "template": spec["template"]}
            with open(f"{sys.argv[2]}/pytorchjob-{role.lower()}.yaml", "w") as f:
                yaml.safe_dump(pt, f)
EOF
  "$venv/bin/kubernetes-validate" --strict --quiet deploy/k8s-job.yaml deploy/k8s-pytorchjob.yaml "$tmp"/*.yaml ||
    fail "a manifest does not validate"
  # The manifests run the image deploy/Dockerfile builds, with the endpoint on the port it documents.
  local tag=${image##*/} m
  for m in deploy/k8s-job.yaml deploy/k8s-pytorchjob.yaml; do
    grep -q "image: .*/${tag}\b" "$m" || fail "$m does not run the image $tag"
    grep -q -- '--set=log.http_port=8080' "$m" || fail "$m does not set log.http_port=8080"
    grep -q -- '--set=log.http_host=0.0.0.0' "$m" || fail "$m does not set log.http_host=0.0.0.0"
    grep -q 'containerPort: 8080' "$m" || fail "$m does not expose 8080"
    # A replacement pod waits for the run folder longer than the old pod may take to save and exit.
    local wait grace
    wait=$(grep -oE -- '--wait-for-run-dir=[0-9]+' "$m" | head -1 | cut -d= -f2)
    grace=$(grep -oE 'terminationGracePeriodSeconds: [0-9]+' "$m" | head -1 | awk '{print $2}')
    [[ -n $wait && -n $grace && $wait -gt $grace ]] ||
      fail "$m: --wait-for-run-dir (${wait:-none}) must exceed terminationGracePeriodSeconds (${grace:-none})"
  done
  grep -q '^EXPOSE 8080$' deploy/Dockerfile || fail "deploy/Dockerfile does not EXPOSE 8080"
  rm -rf "$tmp"
  echo "k8s: deploy/k8s-job.yaml and deploy/k8s-pytorchjob.yaml validate (kubernetes-validate --strict)"
}

for p in "${phases[@]}"; do
  t0=$SECONDS
  case $p in
    base|build|run|k8s) $p ;;
    *) echo "error: container-test.sh: unknown phase '$p' (base, build, run, k8s)" >&2; exit 2 ;;
  esac
  echo "== container $p: $((SECONDS - t0)) s"
done
