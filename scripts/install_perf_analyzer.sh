#!/usr/bin/env bash
# Install NVIDIA perf_analyzer into DIR (default ~/opt/perf-analyzer) without touching the system;
# prints the path of the executable last. Idempotent: a step whose result exists is skipped.
#
# Where the binary comes from: the tritonclient 2.51.0 wheel ships perf_analyzer (the 2.52-2.60
# wheels ship one that needs glibc 2.38, later ones none, and the PyPI "perf-analyzer" package is a
# placeholder). It links against libcudart (a pip package; no GPU is needed to run it) and libb64
# (a Debian package, unpacked into DIR with dpkg -x, never installed).
#
#   DIR/venv           tritonclient[all]==2.51.0 + nvidia-cuda-runtime-cu12
#   DIR/libb64         the unpacked libb64 .deb
#   DIR/perf_analyzer  wrapper that sets LD_LIBRARY_PATH relative to itself (DIR can be moved)
set -euo pipefail
DIR=${1:-$HOME/opt/perf-analyzer}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

if [ ! -x "$DIR/venv/bin/perf_analyzer" ]; then
    "$PY" -m venv "$DIR/venv"
    "$DIR/venv/bin/python" -m pip install -q --upgrade pip
    "$DIR/venv/bin/python" -m pip install -q 'tritonclient[all]==2.51.0' nvidia-cuda-runtime-cu12
fi

b64_lib() { find "$DIR/libb64" -name 'libb64.so.0d*' 2>/dev/null | head -n 1; }
if [ -z "$(b64_lib)" ]; then
    mkdir -p "$DIR/debs"
    (cd "$DIR/debs" && { apt-get download libb64-0d 2>/dev/null || { apt-get update -qq && apt-get download libb64-0d; }; })
    dpkg -x "$(ls "$DIR"/debs/libb64-0d_*.deb | head -n 1)" "$DIR/libb64"
fi

b64_dir=$(dirname "$(b64_lib)")
cudart_dir=$(dirname "$(find "$DIR/venv" -name 'libcudart.so.12*' | head -n 1)")
cat > "$DIR/perf_analyzer" <<WRAPPER
#!/usr/bin/env bash
# Written by Pier's scripts/install_perf_analyzer.sh: runs perf_analyzer with its libraries.
set -euo pipefail
here=\$(cd "\$(dirname "\$(readlink -f "\$0")")" && pwd)
export LD_LIBRARY_PATH="\$here/${b64_dir#"$DIR"/}:\$here/${cudart_dir#"$DIR"/}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "\$here/venv/bin/perf_analyzer" "\$@"
WRAPPER
chmod +x "$DIR/perf_analyzer"
"$DIR/perf_analyzer" --version >&2
echo "$DIR/perf_analyzer"
