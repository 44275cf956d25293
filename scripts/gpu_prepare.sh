#!/usr/bin/env bash
# Build, on this (CPU) machine, what `scripts/gpu_checks.sh` carries to a lent GPU machine, so a
# device session spends its first minutes on the GPU, not on gathering files:
#   .whl/        cp312 manylinux wheels of every package Tandem needs at run time that the GPU
#                image lacks, at .venv's versions (scripts/gpu_wheels.py says which)
#   .gpu/a/part1 .gpu/b/part2   the built-in GGUF in two parts (a call carries 64 MiB)
#   .gpu/stack/debs/            Debian's redis-server, redis-tools, libjemalloc2, liblzf1
#   .gpu/stack/hf/              the built-in model's config.json and tokenizer files (stage
#                               stack makes random weights of its shape on the GPU)
# and lists each path's size; every path must stay under 64 MiB with the tree. The paths are
# ignored by git (.git/info/exclude). Needs .venv (scripts/setup.sh --test), pip and apt-get.
#   scripts/gpu_prepare.sh            # all of them (about a minute)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
for p in /.whl/ /.gpu/ /gpu-out/; do
    grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >>.git/info/exclude
done

# the GPU image's packages: the tool library's device/KINDS.md
kinds=${KINDS_MD:-../.library/device/KINDS.md}
rm -rf .whl && mkdir -p .whl
"$PY" -m scripts.gpu_wheels "$kinds" >/tmp/gpu_wheels.txt
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
while read -r spec; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d .whl "$spec"
done </tmp/gpu_wheels.txt
echo "wheels: $(ls .whl | wc -l) ($(du -sh .whl | cut -f1)): $(tr '\n' ' ' </tmp/gpu_wheels.txt)"

# the built-in GGUF in two parts
f=$("$PY" -c 'from services.engine.model_files import default_model_path as p; print(p())')
rm -rf .gpu && mkdir -p .gpu/a .gpu/b .gpu/stack/debs .gpu/stack/hf
head -c 60000000 "$f" >.gpu/a/part1
tail -c +60000001 "$f" >.gpu/b/part2
cmp <(cat .gpu/a/part1 .gpu/b/part2) "$f"

# Debian's redis-server and what it links
(cd .gpu/stack/debs && apt-get download -q redis-server redis-tools libjemalloc2 liblzf1 >/dev/null)

# the model's config and tokenizer, as transformers reads them from the GGUF
"$PY" - "$f" .gpu/stack/hf <<'PY'
import sys
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

path, out = Path(sys.argv[1]), sys.argv[2]
AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
PY
du -sh .whl .gpu/a .gpu/b .gpu/stack
