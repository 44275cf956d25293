#!/usr/bin/env bash
# Build the CPU image with podman from a base made here, then run its smoke test.
#   scripts/build_image.sh [--torch-wheel FILE] [--no-smoke] [--out DIR] [--repeat N]
# Needs: root (debootstrap), podman with runc, debootstrap (Debian: apt-get install -y podman
# debootstrap), Debian's mirror and PyPI reachable, and the checkout's .venv (scripts/setup.sh)
# for the smoke test's client. No upstream image is pulled: the base is Debian bookworm with its
# Python 3.11, made with debootstrap and imported as localhost/tandem-base:bookworm (made once;
# `podman rmi localhost/tandem-base:bookworm` to make it again), standing in for
# python:3.11-slim-bookworm. Every container gets --ulimit nofile/nproc, which runc needs where
# the default limits cannot be set (as in this project's sandbox).
#   --torch-wheel FILE  a local CPU torch 2.13.0 wheel, for where download.pytorch.org (the
#                       Dockerfile's TORCH_INDEX_URL) is unreachable; served to the build as a
#                       one-package index
#   --out DIR           where the smoke test (scripts/smoke_image.py) writes image.json
#                       (default bench-results)
#   --repeat N          the smoke test's timed starts of a decode worker (default 3)
# Also mounted into the build, not copied into the image: this machine's CA bundle (a TLS proxy's
# CA reaches pip this way).
set -euo pipefail
cd "$(dirname "$0")/.."

base=localhost/tandem-base:bookworm
image=localhost/tandem:0.1.0-cpu
torch_wheel="" smoke=1 out=bench-results repeat=3
while [ $# -gt 0 ]; do
  case "$1" in
    --torch-wheel) torch_wheel="$2"; shift 2 ;;
    --no-smoke) smoke=0; shift ;;
    --out) out="$2"; shift 2 ;;
    --repeat) repeat="$2"; shift 2 ;;
    *) echo "usage: scripts/build_image.sh [--torch-wheel FILE] [--no-smoke] [--out DIR]" \
            "[--repeat N]" >&2; exit 2 ;;
  esac
done
for tool in podman; do
  command -v "$tool" >/dev/null || { echo "build_image: $tool not found (apt-get install -y podman)" >&2; exit 1; }
done
ulimits=(--ulimit nofile=20000:20000 --ulimit nproc=32768:32768)
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

if ! podman image exists "$base"; then
  command -v debootstrap >/dev/null || { echo "build_image: debootstrap not found" >&2; exit 1; }
  echo "build_image: making $base with debootstrap (a few minutes)" >&2
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm \
    "$scratch/rootfs" http://deb.debian.org/debian >"$scratch/debootstrap.log" \
    || { tail -20 "$scratch/debootstrap.log" >&2; exit 1; }
  rm -rf "$scratch"/rootfs/var/cache/apt/archives/*.deb "$scratch"/rootfs/var/lib/apt/lists/*
  tar -C "$scratch/rootfs" -c . | podman import --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$base" >/dev/null
  rm -rf "$scratch/rootfs"
fi

build=(--target cpu --build-arg "CPU_BASE=$base" -t "$image")
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  build+=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
fi
if [ -n "$torch_wheel" ]; then
  wheel="$(realpath "$torch_wheel")"
  name="$(basename "$wheel")"
  mkdir -p "$scratch/index/torch"
  printf '<a href="file:///torch-wheel/%s">%s</a>\n' "${name//+/%2B}" "$name" \
    >"$scratch/index/torch/index.html"
  build+=(--volume "$scratch/index:/torch-index:ro" --volume "$(dirname "$wheel"):/torch-wheel:ro"
          --build-arg TORCH_INDEX_URL=file:///torch-index)
fi
echo "build_image: podman build ${build[*]} ." >&2
start=$(date +%s)
podman build "${ulimits[@]}" "${build[@]}" .
echo "build_image: built $image in $(( $(date +%s) - start )) s" >&2

if [ "$smoke" = 1 ]; then
  .venv/bin/python -m scripts.smoke_image --image "$image" --out "$out" --repeat "$repeat"
fi
