#!/usr/bin/env bash
# One H200 call for issue 3: GPU tests, the TPS benchmark (S2-Pro shape) and a kernel profile.
# Run through the device tool from the repo root with `carry: [".whl"]` (num2words, docopt wheels).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
STEP=${STEP:-all}
if [[ $STEP == all || $STEP == tests ]]; then
  TTS_TEST_REPORT=$OUT/cuda_report.json timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py 2>&1 | tail -40 | tee $OUT/cuda_tests.log
fi
if [[ $STEP == all || $STEP == bench ]]; then
  timeout 250 python3 -m tts.cli.main bench --model s2-pro-shape --device cuda --batch-sizes ${BATCHES:-1,4,16,64} \
    --frames ${FRAMES:-64} --out $OUT 2>&1 | tee $OUT/bench.log
fi
if [[ $STEP == all || $STEP == profile ]]; then
  timeout 100 python3 scripts/profile_step.py --model s2-pro-shape --batch 1 --out $OUT/profile.txt > /dev/null 2>&1
  head -c 4000 $OUT/profile.txt
fi
