#!/usr/bin/env bash
# The GPU runs of docs/results/gpu/ in one go (on a machine with one GPU and the
# image's python3, torch and transformers; geosharp from src/). Output under $OUT.
set -o pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
python3 benchmarks/bench_llama_gpu.py --shape tiny --tokens 64 || exit 1  # a smoke test
# under 8 minutes in all: the smoke test, then 120 s and 270 s at most
timeout 120 python3 benchmarks/bench_llama_gpu.py --shape 1.1b --json "$OUT/gpu_1b.json" 2>&1 | tee "$OUT/gpu_1b.log"
timeout 270 python3 benchmarks/bench_llama_gpu.py --shape 7b --checkpointed --json "$OUT/gpu_7b.json" 2>&1 | tee "$OUT/gpu_7b.log"
# every ratio to the bfloat16 forward+backward, and the peak beyond it
python3 - "$OUT"/gpu_1b.json "$OUT"/gpu_7b.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        rows = json.load(open(path))
    except (OSError, ValueError):
        print(f"{path}: no results"); continue
    for r in rows:
        print(f"{r['shape']:5} {r['mode']:45} {r['step_over_forward_backward']:6.2f}x  "
              f"{1e3 * r['seconds']:7.0f} ms  peak +{r['peak_growth_gib']:5.1f} GiB  "
              f"{r['buffers_beyond_step']:5.2f} vectors")
PY
if [ -n "$PEAKS" ]; then
  timeout 100 python3 benchmarks/bench_llama_gpu.py --shape 1.1b --peaks --json "$OUT/peaks_1b.json" 2>&1 | tee "$OUT/peaks_1b.log"
fi
if [ -n "$TREND" ]; then
  timeout 100 python3 benchmarks/step_trend.py --device cuda --batches 16 64 256 --n-iters 6 \
    --repeats 3 --json "$OUT/trend_gpu.json" 2>&1 | tee "$OUT/trend_gpu.log"
fi
