#!/usr/bin/env bash
# Builds Pier's CPU image (docker/Dockerfile) and its slim variant (docker/Dockerfile.slim), runs
# each and checks it from outside (scripts/image_check.py: ready, tritonclient HTTP + gRPC, metrics,
# SIGTERM during a request), then prints the image sizes.
#
#   scripts/image_test.sh [--slim-only] [--keep]
#
# Where no registry is reachable (this project's machines), the base image is made locally from
# Debian with mmdebstrap (IMAGE_BASE overrides it: e.g. python:3.11-slim where Docker Hub is
# reachable). torch's wheel comes from pip's find-links on the host when it is there (a wheelhouse
# in docker/wheels/), and the host's CA bundle goes in as a BuildKit secret (a TLS-intercepting
# proxy): neither lands in the final image. Without Docker (and no way to install it) it prints
# SKIP with the reason and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SLIM_ONLY=0 KEEP=0
for arg in "$@"; do
  case $arg in --slim-only) SLIM_ONLY=1 ;; --keep) KEEP=1 ;; *) echo "unknown argument $arg" >&2; exit 2 ;; esac
done
DOCKER="/usr/bin/docker"
[ -x "$DOCKER" ] || DOCKER=$(command -v docker || true)
log() { echo "[image-test $(date +%H:%M:%S)] $*"; }
skip() { echo "SKIP: $*"; exit 0; }

# -- a Docker daemon ------------------------------------------------------------------------------
if [ -z "$DOCKER" ] || ! "$DOCKER" info >/dev/null 2>&1; then
  if [ -z "$DOCKER" ]; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || skip "no docker, and no root apt-get to install docker.io"
    log "installing docker.io, iptables, mmdebstrap"
    apt-get install -y -q docker.io iptables mmdebstrap >/dev/null 2>&1 || apt-get update -q >/dev/null 2>&1 &&
      apt-get install -y -q docker.io iptables mmdebstrap >/dev/null 2>&1 || skip "apt-get install docker.io failed"
    DOCKER=/usr/bin/docker
  fi
  if ! "$DOCKER" info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || skip "docker is installed but no daemon runs and dockerd is missing"
    log "starting dockerd"
    nohup dockerd --data-root /var/lib/docker -p /run/dockerd.pid > /tmp/pier-dockerd.log 2>&1 &
    for _ in $(seq 1 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 0.5; done
    "$DOCKER" info >/dev/null 2>&1 || skip "dockerd did not start (see /tmp/pier-dockerd.log)"
  fi
fi
export DOCKER_BUILDKIT=1

# -- the base image -------------------------------------------------------------------------------
BASE=${IMAGE_BASE:-local/pier-python:3.11}
if ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
  if [ -n "${IMAGE_BASE:-}" ] && "$DOCKER" pull "$BASE" >/dev/null 2>&1; then
    :
  else
    command -v mmdebstrap >/dev/null || skip "no base image $BASE and no mmdebstrap to make one"
    log "making the base image $BASE from Debian bookworm (mmdebstrap, a few minutes)"
    tmp=$(mktemp -d)
    mmdebstrap --variant=minbase --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates \
      bookworm "$tmp/rootfs.tar" >/dev/null 2>&1 || { rm -rf "$tmp"; skip "mmdebstrap could not reach a Debian mirror"; }
    "$DOCKER" import "$tmp/rootfs.tar" "$BASE-rootfs" >/dev/null
    printf 'FROM %s-rootfs\nENV LANG=C.UTF-8\nRUN rm -f /usr/lib/python3*/EXTERNALLY-MANAGED && rm -rf /var/lib/apt/lists/*\n' \
      "$BASE" > "$tmp/Dockerfile"
    "$DOCKER" build -q -t "$BASE" "$tmp" >/dev/null
    rm -rf "$tmp"
  fi
fi

# -- what the build takes from the host -----------------------------------------------------------
SECRET=()
for ca in "${PIP_CERT:-}" /etc/ssl/certs/ca-certificates.crt; do
  if [ -n "$ca" ] && [ -s "$ca" ]; then SECRET=(--secret "id=pip_ca,src=$ca"); break; fi
done
if [ "$SLIM_ONLY" = 0 ] && ! ls docker/wheels/torch-2.13.0*.whl >/dev/null 2>&1; then
  "$PY" -m pip download -q --no-deps -d docker/wheels 'torch==2.13.0' 2>/dev/null || true  # the host's find-links
fi

# -- a repository: the example models plus a model that sleeps (for the SIGTERM check) ------------
repo=$(mktemp -d)
trap 'rm -rf "$repo" "$repo-slim"' EXIT
git ls-files -z model_repository | xargs -0 -I{} cp --parents {} "$repo/"  # the tracked example models
mv "$repo/model_repository"/* "$repo/" && rmdir "$repo/model_repository"
mkdir -p "$repo/sleep_py/1"
cat > "$repo/sleep_py/config.pbtxt" <<'EOF'
backend: "python"
max_batch_size: 0
input [ { name: "SECONDS" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
EOF
cat > "$repo/sleep_py/1/model.py" <<'EOF'
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            seconds = pb_utils.get_input_tensor_by_name(request, "SECONDS").as_numpy()
            time.sleep(float(seconds[0]))
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", seconds)]))
        return out
EOF
chmod -R a+rX "$repo"
cp -r "$repo" "$repo-slim" && rm -rf "$repo-slim/mlp_torchscript"  # no torch in the slim image

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

run_check() {  # TAG [--slim]
  local tag=$1 flag=${2:-} name="pier-image-test-$$-${1//[:\/]/-}" models=$repo
  local h g m
  [ "$flag" = --slim ] && models=$repo-slim
  h=$(free_port); g=$(free_port); m=$(free_port)
  "$DOCKER" run -d --name "$name" -p "127.0.0.1:$h:8000" -p "127.0.0.1:$g:8001" -p "127.0.0.1:$m:8002" \
    -v "$models:/models:ro" "$tag" >/dev/null
  if ! "$PY" scripts/image_check.py "$name" "$h" "$g" "$m" $flag; then
    "$DOCKER" logs "$name" 2>&1 | tail -40
    "$DOCKER" rm -f "$name" >/dev/null 2>&1 || true
    echo "FAIL: $tag"
    exit 1
  fi
  "$DOCKER" rm -f "$name" >/dev/null 2>&1 || true
}

build() {  # DOCKERFILE TAG
  log "building $2 ($1) on $BASE"
  local start=$SECONDS
  "$DOCKER" build -q -f "$1" -t "$2" --build-arg "BASE_IMAGE=$BASE" "${SECRET[@]}" . >/dev/null
  log "built $2 in $((SECONDS - start)) s"
}

build docker/Dockerfile.slim pier:slim-test
run_check pier:slim-test --slim
if [ "$SLIM_ONLY" = 0 ]; then
  build docker/Dockerfile pier:cpu-test
  run_check pier:cpu-test
fi
echo "image sizes:"
for tag in pier:slim-test pier:cpu-test; do
  "$DOCKER" image inspect "$tag" >/dev/null 2>&1 &&
    printf '  %-16s %s MB\n' "$tag" "$("$DOCKER" image inspect --format '{{.Size}}' "$tag" | awk '{printf "%d", $1/1e6}')"
done
if [ "$KEEP" = 0 ]; then "$DOCKER" image rm pier:slim-test pier:cpu-test >/dev/null 2>&1 || true; fi
echo "PASS: image test"
