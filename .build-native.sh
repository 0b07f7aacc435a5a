#!/usr/bin/env bash
# Rebuilds tidekv._native (and plugins/trtllm's libtransfer_engine.so) next to the sources without disturbing processes that have it loaded
# (the new file replaces the old one by rename, never by rewriting it in place).
set -euo pipefail
cd "$(dirname "$0")"
out=$(mktemp -d)
.venv/bin/python setup.py -q build_ext -b "$out" -t "$out/tmp" -j 2 >/dev/null
so=$(ls "$out"/tidekv/_native*.so)
cp "$so" core/.native.new.so && mv -f core/.native.new.so "core/$(basename "$so")"
# The C API for TensorRT-LLM (plugins/trtllm), built from the same objects, the same way.
mkdir -p plugins/trtllm/lib
cp "$out/tidekv_trtllm/lib/libtransfer_engine.so" plugins/trtllm/lib/.libtransfer_engine.new.so \
  && mv -f plugins/trtllm/lib/.libtransfer_engine.new.so plugins/trtllm/lib/libtransfer_engine.so
rm -rf "$out"
