#!/usr/bin/env bash
# On the accelerator, call 1 of 2: keep the first half of the GGUF under /tmp.
set -euo pipefail
mkdir -p /tmp/specjax_slot
cp out/carry/part1/gguf.part /tmp/specjax_slot/gguf.part1
ls -l /tmp/specjax_slot
