#!/usr/bin/env bash
# KV memory on demand and batches past 64 on one GPU: the CUDA tests, then `tts bench` (S2-Pro shape,
# graph mode) with the code before the change (OLD, default .scratch/old: batches 1, 64, 128) and after
# (this tree: batches 1, 64, 128, 256), and the max batch `tts serve --max-batch auto` picks for the
# S2-Pro shape there. Before the call, here: `mkdir -p .scratch/old && git archive BASE tts graphs service
# tts_grpc | tar -x -C .scratch/old` (BASE: the commit before the change), then the device tool with
# carry [".scratch/old"] runs `bash tools/gpu/gpu_kv_pool.sh` from the tree root (about 9 minutes at most).
# (The tree before the change had the old layout, whose `python -m tts.cli bench` needs no install.)
# Writes under $OUT: env.txt, install.log, cuda_tests.log, bench_new.txt, new/bench.json, bench_old.txt,
# old/bench.json, auto.txt. Packages the image lacks and these runs do not use (num2words: text
# normalization; soundfile: WAV files) are stubbed when missing; the default voice's test needs its
# frontend's wheels (phonemizer, espeakng-loader) carried and installed as for the other GPU scripts.
set -uo pipefail
OLD=$(cd "${OLD:-.scratch/old}" && pwd) || exit 2
mkdir -p /tmp/stub
python3 -c "import num2words" 2>/dev/null ||
  echo "def num2words(*a, **k): raise RuntimeError('num2words is not installed here')" > /tmp/stub/num2words.py
python3 -c "import soundfile" 2>/dev/null ||
  echo "def __getattr__(name): raise AttributeError('soundfile is not installed here')" > /tmp/stub/soundfile.py
# `tts bench` is registered as an entry point (tts_tools): the project installed, its dependencies as found
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || echo "install failed"
export PYTHONPATH=$PWD:$PWD/tools:/tmp/stub${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  ls /tmp/stub
} | tee $OUT/env.txt
timeout 170 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py tests/test_dac_batched.py \
  tests/test_melvq_batched.py > $OUT/cuda_tests.log 2>&1
echo "cuda tests: rc $?"; tail -4 $OUT/cuda_tests.log
BENCH="bench --model s2-pro-shape --device cuda --modes graph --frames 64 --warmup-frames 32"
timeout 160 python3 -m tts.cli $BENCH --batch-sizes 1,64,128,256 --out $OUT/new > $OUT/bench_new.txt 2>&1
echo "bench new: rc $?"; tail -8 $OUT/bench_new.txt
(cd $OLD && PYTHONPATH=$OLD:/tmp/stub${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 -m tts.cli $BENCH --batch-sizes 1,64 \
  --out $OUT/old > $OUT/bench_old.txt 2>&1; echo "bench old: rc $?")
tail -6 $OUT/bench_old.txt
timeout 45 python3 -c "
import torch
from tts.model.shapes import build_random_model, shape_config
from tts.engine.engine import max_batch_for_memory, kv_bytes_per_token
m = build_random_model(shape_config('s2-pro-shape'), 'cuda', torch.bfloat16)
free, total = torch.cuda.mem_get_info()
print('free GiB', round(free / 2**30, 1), 'KV bytes/token', kv_bytes_per_token(m),
      'auto max batch', max_batch_for_memory(m, 0.5))
" > $OUT/auto.txt 2>&1
cat $OUT/auto.txt
rm -f $OUT/new/bench.png $OUT/old/bench.png
