#!/usr/bin/env bash
# The loop guard on one H200 (device tool, carry [".whl-voice"]: the default voice's frontend wheels and
# soundfile). Writes $OUT/cuda_tests.log (the CUDA tests: graphs with the aligner in the captured step,
# two threads capturing at once, the codec stages, the engine loop), $OUT/lockless.log (the two-thread
# capture test with graphs.runner.CAPTURE_LOCK replaced by a no-op: what it guards against),
# $OUT/bench_1.json and $OUT/bench_2.json (the default model's frame step with and without its aligner
# heads, batches 1, 16, 64; scripts/loop_guard_gpu.py bench) and $OUT/long_on.npz, $OUT/long_off.npz (the
# held-out passages at seeds 0 and 1 read on the GPU with the guard on and off, 16-bit PCM, for
# `python scripts/loop_guard_gpu.py score` where the ASR is installed; their logs beside them).
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-voice/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py tests/test_dac_batched.py \
  tests/test_melvq_batched.py tests/test_engine_loop.py > $OUT/cuda_tests.log 2>&1
tail -3 $OUT/cuda_tests.log
timeout 120 python3 -c "
import contextlib, sys, pytest, graphs.runner
graphs.runner.CAPTURE_LOCK = contextlib.nullcontext()
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-m', 'cuda', 'tests/test_cuda_graphs.py', '-k', 'two_threads']))
" > $OUT/lockless.log 2>&1
echo "without the capture lock: rc $?"; tail -2 $OUT/lockless.log
for i in 1 2; do
  timeout 240 python3 scripts/loop_guard_gpu.py bench --device cuda --out $OUT/bench_$i.json > /dev/null
done
for g in on off; do
  timeout 150 python3 scripts/loop_guard_gpu.py speak --device cuda --seeds 0,1 --loop-guard $g --out $OUT/long_$g.npz \
    > $OUT/long_$g.log 2>&1
  echo "speak $g: rc $?"; tail -2 $OUT/long_$g.log
done
