#!/usr/bin/env bash
# The wheels `clipstream bench gpu` needs on the team's GPU machine, built here (after `make setup`) into
# build/gpu-wheels/ (git-ignored). That machine has Python 3.12 with torch, numpy, transformers (and its
# dependencies: PyYAML, regex, tqdm, huggingface_hub, packaging...), safetensors and grpcio, reaches no registry, and
# takes at most 64 MiB of files (this repository's tracked files and the wheels together): so no Ray, no MLflow,
# no Qdrant, and never torch. There, in the repository root:
#
#   pip install --no-index --no-deps build/gpu-wheels/*.whl && clipstream bench gpu
#
# (--no-deps: pip installs exactly these wheels and resolves nothing, so it never pulls or replaces torch.)
#
#   benchmarks/gpu_setup.sh [OUT]     env: GPU_PYTHON (3.12), TORCHVISION (0.26.0: the release paired with the
#                                     machine's torch 2.11), PYTHON (.venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/gpu-wheels}
PYTHON=${PYTHON:-.venv/bin/python}
GPU_PYTHON=${GPU_PYTHON:-3.12}
TORCHVISION=${TORCHVISION:-0.26.0}
LIMIT_MIB=64

version() { "$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

rm -rf "$OUT" && mkdir -p "$OUT"
# DeepSpeed as a pure-Python wheel, the version installed here: DS_BUILD_OPS=0 compiles no op (the step runs torch's
# AdamW: engine.deepspeed_config). Its build imports torch, so the venv's torch, no build isolation.
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "deepspeed==$(version deepspeed)"
# clipstream itself, without its dependencies (Ray, MLflow, Qdrant... stay behind: the benchmark imports none)
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" .
# What the measured code imports that the machine lacks, at the versions tested here, as cp312 manylinux wheels:
# open_clip and timm; torchvision paired with the machine's torch; DeepSpeed's and clipstream's own imports.
PACKAGES=(open_clip_torch timm ftfy wcwidth pillow einops hjson msgpack ninja psutil py-cpuinfo pydantic pydantic_core
          annotated-types typing-inspection pydantic-settings python-dotenv braceexpand)
PINNED=("torchvision==$TORCHVISION")
for name in "${PACKAGES[@]}"; do PINNED+=("$name==$(version "$name")"); done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  -d "$OUT" "${PINNED[@]}"

wheels=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | awk '/\ttotal$/ {sum += $1} END {print sum}')
total=$((wheels + tree))
ls -1 "$OUT"
printf 'gpu-wheels: %d wheels, %.1f MiB + repository %.1f MiB = %.1f MiB (limit %d MiB)\n' "$(ls "$OUT"/*.whl | wc -l)" \
  "$(echo "$wheels / 1048576" | bc -l)" "$(echo "$tree / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)" "$LIMIT_MIB"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu-wheels: over the ${LIMIT_MIB} MiB the GPU machine takes" >&2
  exit 1
fi
