#!/usr/bin/env bash
# Builds Pier's CPU image (docker/Dockerfile) and its slim variant (docker/Dockerfile.slim), runs
# each and checks it from outside (scripts/image_check.py: ready, tritonclient HTTP + gRPC, metrics,
# SIGTERM during a request), then prints the image sizes. Between the two, the Helm chart's
# Deployment runs as a pod: rendered for the slim image (enough: the chart is the same for both,
# and it loads into podman in a quarter of the time), with the example `simple` model from a
# ConfigMap and hostPorts on 127.0.0.1, through `podman kube play`, checked from outside (its
# probes sent as a kubelet would, tritonclient HTTP + gRPC, metrics, exit 0 on `podman pod stop`),
# then `podman kube down`.
#
#   scripts/image_test.sh [--slim-only] [--no-kube] [--keep]
#
# Where no registry is reachable (this project's machines), the base image is made locally from
# Debian with mmdebstrap (IMAGE_BASE overrides it: e.g. python:3.11-slim where Docker Hub is
# reachable). torch's wheel comes from pip's find-links on the host when it is there (a wheelhouse
# in docker/wheels/), and the host's CA bundle goes in as a BuildKit secret (a TLS-intercepting
# proxy): neither lands in the final image. Without Docker (and no way to install it) it prints
# SKIP with the reason and exits 0; so does the pod check without podman or helm (as root it
# installs podman and catatonit with apt, helm with scripts/install_deploy_tools.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SLIM_ONLY=0 KEEP=0 KUBE=1
for arg in "$@"; do
  case $arg in
    --slim-only) SLIM_ONLY=1 ;; --no-kube) KUBE=0 ;; --keep) KEEP=1 ;;
    *) echo "unknown argument $arg" >&2; exit 2 ;;
  esac
done
DOCKER="/usr/bin/docker"
[ -x "$DOCKER" ] || DOCKER=$(command -v docker || true)
log() { echo "[image-test $(date +%H:%M:%S)] $*"; }
skip() { echo "SKIP: $*"; exit 0; }
apt_install() {  # PACKAGE...: as root with apt-get (an update first only if the lists are stale)
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  log "installing $* (apt)"
  apt-get install -y -q "$@" >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$@" >/dev/null 2>&1; }
}

# -- a Docker daemon ------------------------------------------------------------------------------
if [ -z "$DOCKER" ] || ! "$DOCKER" info >/dev/null 2>&1; then
  if [ -z "$DOCKER" ] || ! command -v dockerd >/dev/null; then  # none, or a client without its daemon
    apt_install docker.io iptables mmdebstrap || skip "no Docker daemon, and apt-get could not install docker.io"
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
kube=$repo-kube  # the pod check's files
cleanup() {
  if [ -f "$kube/play.yaml" ]; then
    podman kube down "$kube/play.yaml" >/dev/null 2>&1 || true
    podman volume rm -f "$(cat "$kube/volume")" >/dev/null 2>&1 || true
  fi
  rm -rf "$repo" "$repo-slim" "$kube"
}
trap cleanup EXIT
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

# -- the chart's Deployment as a pod (podman kube play) ---------------------------------------------
kube_skip() { echo "SKIP: podman kube play of the chart's Deployment: $*"; }

kube_check() {  # TAG: an image in Docker's store
  local tag=$1 name="pier-kube-$$" h g m pod ctr mp start=$SECONDS
  local helm podman_rt=() tools=${PIER_DEPLOY_TOOLS:-$HOME/opt/k8s-tools}
  if ! command -v podman >/dev/null; then
    apt_install podman catatonit || { kube_skip "no podman, and apt-get could not install it"; return 0; }
  fi
  # This kind of VM caps the open-files limit below podman's default (1048576): without a lower
  # default the OCI runtime fails ("setrlimit RLIMIT_NOFILE: operation not permitted").
  if [ "$(ulimit -Hn)" != unlimited ] && [ "$(ulimit -Hn)" -lt 1048576 ] &&
     ! grep -qs default_ulimits /etc/containers/containers.conf /etc/containers/containers.conf.d/*.conf \
       "$HOME/.config/containers/containers.conf" "$HOME/.config/containers/containers.conf.d/"*.conf; then
    local conf=$HOME/.config/containers/containers.conf.d/50-pier-ulimits.conf
    [ "$(id -u)" = 0 ] && conf=/etc/containers/containers.conf.d/50-pier-ulimits.conf
    log "podman: default ulimits nofile=20000, nproc=32768 ($conf)"
    mkdir -p "$(dirname "$conf")"
    printf '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n' > "$conf"
  fi
  # runc: crun refuses this VM's hybrid cgroup hierarchy ("cgroups in hybrid mode not supported").
  if command -v runc >/dev/null; then podman_rt=(--runtime "$(command -v runc)"); fi
  helm=$(command -v helm || true)
  if [ -z "$helm" ] && [ -x "$tools/bin/helm" ]; then helm=$tools/bin/helm; fi
  if [ -z "$helm" ]; then
    helm=$(bash scripts/install_deploy_tools.sh --helm "$tools")/helm || { kube_skip "helm could not be installed"; return 0; }
  fi
  log "loading $tag into podman"
  "$DOCKER" save "$tag" | podman load -q >/dev/null
  mkdir -p "$kube"
  h=$(free_port); g=$(free_port); m=$(free_port)
  # The values a user playing the chart on one machine would give: the local image, never pulled,
  # hostPorts on loopback, the repository from a ConfigMap (items lay out its folders), short probes.
  cat > "$kube/values.yaml" <<EOF
image: {repository: ${tag%%:*}, tag: ${tag#*:}, pullPolicy: Never}
hostPorts: {http: $h, grpc: $g, metrics: $m, hostIP: 127.0.0.1}
modelRepository:
  configMap:
    name: $name-models
    items:
      - {key: simple.config.pbtxt, path: simple/config.pbtxt}
      - {key: simple.model.onnx, path: simple/1/model.onnx}
resources: {requests: {cpu: 250m, memory: 256Mi}, limits: {memory: 2Gi}}
probes: {periodSeconds: 2, startupFailureThreshold: 90}
shutdown: {preStopSleepSeconds: 1, exitTimeoutSeconds: 10}
EOF
  "$PY" -c 'import base64, json, pathlib, sys
simple = pathlib.Path(sys.argv[2])
print(json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": sys.argv[1]},
                  "data": {"simple.config.pbtxt": (simple / "config.pbtxt").read_text()},
                  "binaryData": {"simple.model.onnx": base64.b64encode((simple / "1/model.onnx").read_bytes()).decode()}}))' \
    "$name-models" model_repository/simple > "$kube/configmap.yaml"
  "$helm" template "$name" deploy/helm/pier -f "$kube/values.yaml" --show-only templates/deployment.yaml \
    > "$kube/deployment.yaml"
  { cat "$kube/configmap.yaml"; echo ---; cat "$kube/deployment.yaml"; } > "$kube/play.yaml"
  # podman writes a ConfigMap's items into a volume named after it, but does not make the folders
  # of an item's path (Kubernetes does): lay them out first in that volume, which kube play reuses.
  echo "$name-models" > "$kube/volume"
  podman volume create "$name-models" >/dev/null
  mp=$(podman volume inspect "$name-models" --format '{{.Mountpoint}}')
  [ -n "$mp" ] && mkdir -p "$mp/simple/1"
  if ! podman "${podman_rt[@]}" kube play "$kube/play.yaml" > "$kube/play.log" 2>&1; then
    cat "$kube/play.log"
    echo "FAIL: podman kube play of the chart's Deployment ($tag)"
    exit 1
  fi
  pod=$(sed -n '/^Pod:/{n;p;}' "$kube/play.log")
  ctr=$(podman ps -a --filter "pod=$pod" --format '{{.Names}} {{.IsInfra}}' | awk '$2 == "false" {print $1}')
  if ! "$PY" scripts/image_check.py --kube "$kube/play.yaml" "$pod" "$ctr"; then
    podman logs "$ctr" 2>&1 | tail -40
    echo "FAIL: podman kube play of the chart's Deployment ($tag)"
    exit 1
  fi
  podman kube down "$kube/play.yaml" >/dev/null 2>&1
  podman volume rm -f "$name-models" >/dev/null
  rm -f "$kube/play.yaml"
  if [ "$KEEP" = 0 ]; then podman image rm "$tag" >/dev/null 2>&1 || true; fi
  log "pod check done in $((SECONDS - start)) s"
  echo "PASS: podman kube play of the chart's Deployment ($tag)"
}

build() {  # DOCKERFILE TAG
  log "building $2 ($1) on $BASE"
  local start=$SECONDS
  "$DOCKER" build -q -f "$1" -t "$2" --build-arg "BASE_IMAGE=$BASE" "${SECRET[@]}" . >/dev/null
  log "built $2 in $((SECONDS - start)) s"
}

build docker/Dockerfile.slim pier:slim-test
run_check pier:slim-test --slim
if [ "$KUBE" = 1 ]; then kube_check pier:slim-test; fi
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
