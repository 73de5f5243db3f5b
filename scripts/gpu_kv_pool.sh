#!/usr/bin/env bash
# KV memory on demand and batches past 64, on one GPU (device tool, carry [".whl", ".scratch/old"]:
# .whl holds the wheels the image lacks (num2words, soundfile, cffi, pycparser, regex, phonemizer,
# espeakng-loader, joblib, attrs, dlinfo), .scratch/old the code before the change (`git archive <base>
# tts graphs service tts_grpc`, tts/assets left out). Writes under $OUT: env.txt, cuda_tests.log (the
# CUDA tests), bench_new.txt and new/bench.json (`tts bench`, S2-Pro shape, graph mode, batches 1, 64,
# 128, 256 with the new defaults), bench_old.txt and old/bench.json (the code before, batches 1, 64, 128),
# auto.txt (the max batch `tts serve --max-batch auto` would pick for the S2-Pro shape here).
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee $OUT/env.txt
test -f tests/test_kv_pool.py || { echo "this is not the wt-gpu tree"; exit 3; }
timeout 180 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py tests/test_dac_batched.py \
  tests/test_melvq_batched.py > $OUT/cuda_tests.log 2>&1
echo "cuda tests: rc $?"; tail -3 $OUT/cuda_tests.log
BENCH="bench --model s2-pro-shape --device cuda --modes graph --frames 64 --warmup-frames 32"
timeout 160 python3 -m tts.cli $BENCH --batch-sizes 1,64,128,256 --out $OUT/new > $OUT/bench_new.txt 2>&1
echo "bench new: rc $?"; tail -8 $OUT/bench_new.txt
(cd .scratch/old && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m tts.cli $BENCH --batch-sizes 1,64,128 \
  --out $OUT/old > $OUT/bench_old.txt 2>&1; echo "bench old: rc $?")
tail -6 $OUT/bench_old.txt
timeout 45 python3 -c "
import torch
from tts.shapes import build_random_model, shape_config
from tts.engine.engine import max_batch_for_memory, kv_bytes_per_token
m = build_random_model(shape_config('s2-pro-shape'), 'cuda', torch.bfloat16)
free, total = torch.cuda.mem_get_info()
print('free GiB', round(free / 2**30, 1), 'KV bytes/token', kv_bytes_per_token(m),
      'auto max batch', max_batch_for_memory(m, 0.5))
" > $OUT/auto.txt 2>&1
cat $OUT/auto.txt
rm -f $OUT/new/bench.png $OUT/old/bench.png
