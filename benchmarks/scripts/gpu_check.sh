#!/usr/bin/env bash
# The CUDA check, run once on a lent GPU machine (docs/gpu.md). It proves the CUDA path and measures the
# step cost the simulator's roofline projects:
#   1. tests/engine/test_cuda.py: batched greedy parity with generate() on the GPU, both policies;
#   2. `python -m benchmarks fit-cost` on random-weight checkpoints of two shapes (the weights' values do not change a
#      step's cost, and the real weights do not fit the transfer), fitted like the CPU's cost.json;
#   3. `python -m benchmarks ab`, dynamic against continuous on the GPU, mixed workload, exact lengths.
# Needs torch with CUDA and transformers on the machine, the rest as wheels in .whl/ (carried), and a tokenizer
# folder in .gpu/tokenizer (carried). Results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"

timeout 150 python3 -m pytest -q -p no:cacheprovider -o filterwarnings= -m cuda tests/engine/test_cuda.py 2>&1 \
  | tee "$OUT/pytest-cuda.txt" | tail -5

for shape in smollm2-135m llama-3.2-1b; do
  timeout 60 python3 -m benchmarks random-checkpoint --config "$shape" --tokenizer .gpu/tokenizer \
    --dtype bfloat16 --out "/tmp/ckpt-$shape" 2>&1 | tail -1
  timeout 120 python3 -m benchmarks fit-cost --model "/tmp/ckpt-$shape" --device cuda --dtype bfloat16 \
    --quantization none --batch-sizes 1,4,16,64,256 --prefill-tokens 0,128,512,2048 --contexts 128,1024 \
    --max-model-len 4096 --repeats 3 --out "$OUT/cost-h200-$shape.json" 2>&1 | tail -2
done

[ -n "${SKIP_AB:-}" ] || timeout 200 python3 -m benchmarks ab --model /tmp/ckpt-smollm2-135m --device cuda --dtype bfloat16 \
  --quantization none --workload mixed --num-prompts 256 --seats 64 --request-rate inf --baselines none \
  --export-workload --out "$OUT/ab-h200" 2>&1 | tail -12
for f in result.json report.md; do cp "$OUT/ab-h200/$f" "$OUT/ab-h200-$f" 2>/dev/null; done
mkdir -p "$OUT/ab-h200-workload" && cp "$OUT"/ab-h200/workload/*.jsonl "$OUT/ab-h200-workload/" 2>/dev/null
rm -rf "$OUT/ab-h200"
ls -la "$OUT"
