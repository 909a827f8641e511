#!/usr/bin/env bash
# The GPU issue's device check, one command on a bare CUDA machine (torch with CUDA,
# transformers and triton installed; the tree carries the rest): the gpu tests, the Triton
# compile check, then per model shape (bf16, dummy weights) the decode step against the
# HBM roofline with each attention backend (triton: CUDA graphs on) and `conveyor bench`
# synchronous/eager against async scheduling with triton. Budget: under 8 minutes on an
# H200 (not yet run on one: no device was lent when this was written).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), torch.__version__)"
python -m pytest -q -m gpu tests/test_gpu.py
# Every Triton kernel built for the device's and the other targets' cubins.
timeout 200 python scripts/triton_compile_check.py --arch sm_80,sm_90
backends="triton sdpa"  # and flashinfer where it is installed (pip install '.[flashinfer]')
python -c "import flashinfer" 2>/dev/null && backends="triton flashinfer sdpa"
for model in qwen3-0.6b llama3-8b; do
    for backend in $backends; do
        timeout 150 python -m benchmarks.steps.gpu_decode --model "$model" --batches 1,8,64,256 \
            --steps 10 --attention-backend "$backend"
    done
    # sync (eager sdpa) against async scheduling with triton attention and CUDA graphs
    for flags in "" "--async-scheduling --attention-backend triton"; do
        timeout 120 python -m conveyor.entrypoints.cli bench --model "$model" --load-format dummy \
            --device cuda --dtype bfloat16 --num-requests 64 --input-len fixed:512 \
            --output-len fixed:128 --max-num-seqs 64 $flags
    done
done
