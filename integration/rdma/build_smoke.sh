#!/usr/bin/env bash
# Builds integration/rdma/fabric_smoke from native/ (the data path without its Python bindings)
# into the folder given (default: integration/rdma/build). Needs g++ only: libfabric is opened at
# run time.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-integration/rdma/build}
mkdir -p "$out"
sources=$(find native -name '*.cpp' ! -path native/bindings.cpp ! -path native/engine/bindings.cpp \
  ! -path native/common/bindings_errors.cpp | sort)
# shellcheck disable=SC2086
g++ -std=c++17 -O2 -g0 -Wall -Wextra -Wno-unused-parameter -Inative $sources integration/rdma/fabric_smoke.cpp \
  -o "$out/fabric_smoke" -pthread -ldl
echo "$out/fabric_smoke"
