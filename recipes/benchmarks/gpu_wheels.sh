#!/usr/bin/env bash
# The wheels gpu_step.sh installs on a GPU machine without a package registry: run this where PyPI is reachable,
# then carry the folder to the GPU machine (the device tool's `carry` takes ignored paths, 64 MiB in all).
#
#   bash recipes/benchmarks/gpu_wheels.sh            # into .gpu_wheels/ (ignored by git)
#   WHEELS=DIR PACKAGES="trl liger-kernel" bash recipes/benchmarks/gpu_wheels.sh
#
# --no-deps: only these packages, not torch, triton or transformers, which the GPU machine has. deepspeed and
# (on some releases) cut-cross-entropy publish no wheel: pip then downloads the source archive, which
# gpu_step.sh installs only where it needs no build (a pure-Python package). Prints each file's size and the total.
set -uo pipefail
cd "$(dirname "$0")/../.."
WHEELS=${WHEELS:-.gpu_wheels}
PACKAGES=${PACKAGES:-cut-cross-entropy liger-kernel trl datasets deepspeed}
PYTHON=${PYTHON:-python3}
mkdir -p "$WHEELS"
status=0
for package in $PACKAGES; do
  # One at a time, so that one missing package does not stop the others.
  "$PYTHON" -m pip download --no-deps --quiet --dest "$WHEELS" "$package" || { echo "no download: $package" >&2; status=1; }
done
du -b "$WHEELS"/* 2>/dev/null | awk '{printf "%10.2f MiB  %s\n", $1 / 2^20, $2; total += $1} END {printf "%10.2f MiB  total\n", total / 2^20}'
exit $status
