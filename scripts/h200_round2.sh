#!/usr/bin/env bash
# H200 runs after the first optimization round: STEP=a (GPU tests, TPS bench, profile) or STEP=b (a real-format
# S2-Pro checkpoint: write, load, bench; then serve it and run the service load benchmark).
# STEP=c: only the checkpoint and the service load benchmark. Run from the repo root through the device tool with `carry: [".whl"]`.
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, triton, grpc; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'grpc', grpc.__version__)" | tee -a $OUT/gpu.txt
if [[ ${STEP:-a} == a ]]; then
  TTS_TEST_REPORT=$OUT/cuda_report.json timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py 2>&1 | tail -5 | tee $OUT/cuda_tests.log
  timeout 200 python3 -m tts.cli.main bench --model s2-pro-shape --device cuda --batch-sizes 1,4,16,64 --frames 64 --out $OUT 2>&1 | tail -12
  timeout 100 python3 scripts/profile_step.py --model s2-pro-shape --batch 1 --out $OUT/profile.txt > /dev/null 2>&1
  head -c 2500 $OUT/profile.txt
else
  t0=$(date +%s)
  timeout 240 python3 -m tts.cli.main write-checkpoint --shape s2-pro --out /tmp/s2 2>&1 | tail -2
  echo "write-checkpoint: $(( $(date +%s) - t0 )) s"; ls -la /tmp/s2
  if [[ ${STEP} == b ]]; then
  timeout 60 python3 -m tts.cli.main info --model /tmp/s2 --device cuda 2>&1 | tail -3
  timeout 120 python3 -m tts.cli.main bench --model /tmp/s2 --device cuda --modes graph --batch-sizes 1,64 --frames 32 --out $OUT/ckpt 2>&1 | tail -5
  fi
  python3 -m tts.cli.main serve --model /tmp/s2 --device cuda --max-batch 64 --max-waiting 256 --graphs startup --port 50061 --metrics-port -1 > $OUT/serve.log 2>&1 &
  python3 - <<'PY'
import time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
t0 = time.time()
while time.time() - t0 < 240:
    try:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel("127.0.0.1:50061"))
        if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
            print(f"server SERVING after {time.time() - t0:.1f} s"); break
    except grpc.RpcError:
        pass
    time.sleep(1)
PY
  timeout 300 python3 -m tts.cli.main bench-server --server 127.0.0.1:50061 --concurrency 1,4,16,64 --max-new-frames 128 --timeout 120 --json $OUT/bench_server.json 2>&1 | tail -15
  kill %1; wait; tail -5 $OUT/serve.log
fi
