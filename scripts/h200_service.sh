#!/usr/bin/env bash
# The service at engine speed, on one H200: the runs behind BENCHMARKS.md's service tables.
# Run from the repo root through the device tool with `carry: [".whl"]` (.whl: the wheels the GPU image
# lacks: soundfile, cffi, pycparser, grpcio 1.85 + health + reflection, protobuf 7, num2words, docopt,
# phonemizer, dlinfo, espeakng-loader, py-spy). Writes everything under $OUT (at most 8 files come back
# from the device: end with `tar`).
#
#   ACTIONS="..." bash scripts/h200_service.sh   runs the named actions in order:
#     tests       every CUDA test (stops if one fails)
#     accuracy    the bfloat16 DAC decode against float32, and fish-speech's way (autocast)
#     dac_bench   the batched DAC decode timed (benchmarks/codec/dac_batched.py, graph replay)
#     synth       `tts synthesize --device cuda` twice, each a fresh process, timed as a user sees it
#     synth_profile  `tts synthesize`'s wall time broken down (scripts/profile_synthesize.py)
#     prefill_profile  the S2-Pro prefill alone and packed, timed and profiled (scripts/profile_prefill.py)
#     s2_fp32, s2_bf16, default   the service (S2-Pro with the float32 or bfloat16 codec, or the default
#                 voice) at LEVELS (default 1,16,64,64), 128 frames per request
#     default_gl  the default voice as `default`, its codes decoded by Griffin-Lim instead of the learned vocoder
#     refs        the reference modes (repeated, distinct, registered) at c = 16, float32 codec
#     gil         the default voice at c = 64 for 768 requests while py-spy samples the GIL holder
#     tps         `tts bench` graph batch 1 and 64 of S2-Pro
#     tar         everything under $OUT into results.tgz, keeping the JSON files beside it
#   A service action may carry server options after a slash, commas for spaces; its files get a tag from
#   them: s2_fp32/--prefill-graphs,off writes s2_fp32_prefillgraphs_off_service.json.
#
# The runs before 2026-12-02's seventh used one STEP block per run (STEP=check, s2, final, default, prio,
# profile, s2only, attn, attn2, prefill, codec, service, last, verify, handover, closing, cli, as
# BENCHMARKS.md names them); that version of this script is at commit 21a3f24.
set -uo pipefail
[[ -n ${ACTIONS:-} ]] || { echo "usage: ACTIONS=\"tests s2_fp32 ... tar\" bash $0 (see the header)"; exit 2; }
[[ -n ${SKIP_PIP:-} ]] || python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export XDG_DATA_HOME=/tmp/xdg  # registered voices
TTS="python3 -m tts.cli.main"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton, grpc; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'grpc', grpc.__version__)" | tee -a $OUT/env.txt
(git log --oneline -1 2>/dev/null || echo "commit: see the session note") | tee -a $OUT/env.txt

serve() {  # serve MODEL PORT METRICS_PORT EXTRA...: start a server, wait until SERVING
  local model=$1 port=$2 mport=$3; shift 3
  $TTS serve --model $model --device cuda --max-batch 64 --max-waiting 256 --graphs startup --port $port \
    --metrics-port $mport --http-port -1 "$@" > $OUT/serve_$port.log 2>&1 &
  python3 - $port $! <<'PY'
import os, sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
port, pid, t0 = sys.argv[1], sys.argv[2], time.time()
while time.time() - t0 < 200 and os.path.exists(f"/proc/{pid}"):  # (a server that died: give up)
    try:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
            print(f"server :{port} SERVING after {time.time() - t0:.1f} s"); break
    except grpc.RpcError:
        pass
    time.sleep(0.5)
PY
}

write_s2() {  # the S2-Pro real-format random checkpoint, to /tmp/s2
  local t0=$(date +%s)
  timeout 150 $TTS write-checkpoint --shape s2-pro --out /tmp/s2 2>&1 | tail -1
  echo "write-checkpoint $(( $(date +%s) - t0 )) s"
}

synthesize_twice() {  # `tts synthesize --device cuda` in two fresh processes, timed as a user sees them
  for s in 1 2; do
    local t0=$(date +%s.%N)
    timeout 60 $TTS synthesize "Please call Stella and ask her to bring these things." --device cuda --seed $s \
      -o /tmp/x$s.pcm 2>&1 | tail -2
    echo "whole command $(python3 -c "import time; print(round(time.time() - $t0, 2))") s"
  done
}

bench() {  # bench PORT MPORT NAME ARGS...
  local port=$1 mport=$2 name=$3; shift 3
  timeout 240 $TTS bench-server --server 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics \
    --timeout 120 --json $OUT/$name.json "$@" 2>&1 | tee $OUT/$name.txt | grep -v "^replicas" | tail -14
}

run_actions() {
  local levels=${LEVELS:-1,16,64,64} a
  local spec extra tag
  for spec in $ACTIONS; do
    a=${spec%%/*}; extra=""; tag=""
    if [[ $spec == */* ]]; then extra=${spec#*/}; extra=${extra//,/ }; tag=_$(echo $extra | tr -d '-' | tr ' ' '_'); fi
    echo "== $spec ($(date +%T))"
    case $a in
      tests)
        timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py tests/test_dac_batched.py \
          tests/test_melvq_batched.py 2>&1 | grep -v "^  " | tail -8 | tee $OUT/cuda_tests.log
        # (a run killed by its timeout prints no summary: no " passed" line is a failure too)
        if grep -Eq "failed|error" $OUT/cuda_tests.log || ! grep -q " passed" $OUT/cuda_tests.log; then exit 1; fi ;;
      accuracy)
        timeout 120 python3 benchmarks/codec/dac_batched.py --device cuda --accuracy-only --out $OUT/dac_accuracy.json \
          2>&1 | grep accuracy ;;
      synth) synthesize_twice ;;
      dac_bench)
        timeout 150 python3 benchmarks/codec/dac_batched.py --device cuda --batches 1,16,64 --frames 4,16 \
          --cudnn-benchmark on --time-budget 120 --out $OUT/dac_batched.json 2>&1 | tail -20 ;;
      synth_profile)
        timeout 90 python3 scripts/profile_synthesize.py --model default --device cuda --out $OUT/synth_profile.txt \
          2>&1 | grep -v "USDT\|gpuGet\|warn" | head -8 ;;
      prefill_profile)
        timeout 150 python3 scripts/profile_prefill.py --model s2-pro-shape --device cuda --tokens 64,128,256 \
          --packed 16 --out $OUT/prefill.txt 2>&1 | grep -v USDT | tail -12 ;;
      gil)
        serve default 50063 9467 $extra
        local pid; pid=$(pgrep -f "serve --model default" | head -1)
        (sleep 3; timeout 30 /tmp/site/bin/py-spy record --pid $pid --duration 8 --rate 250 --threads --gil \
          --format raw -o $OUT/pyspy_gil_default$tag.txt > $OUT/pyspy_record.log 2>&1) &
        bench 50063 9467 default${tag}_spied --concurrency 64 --requests 768 --warmup 0 --max-new-frames 128 \
          --min-new-frames 128
        wait %2 2>/dev/null; kill %1; wait; tail -2 $OUT/pyspy_record.log
        mv $OUT/serve_50063.log $OUT/serve_gil$tag.log ;;
      s2_fp32|s2_bf16|refs)
        [[ -d /tmp/s2 ]] || write_s2
        local dtype=float32; [[ $a == s2_bf16 ]] && dtype=bfloat16
        serve /tmp/s2 50061 9465 --codec-dtype $dtype $extra
        if [[ $a == refs ]]; then
          for mode in repeated distinct registered; do
            bench 50061 9465 s2_reference_$mode$tag --concurrency 16 --requests 64 --max-new-frames 128 \
              --min-new-frames 128 --reference $mode
          done
        else
          bench 50061 9465 $a${tag}_service --concurrency $levels --max-new-frames 128 --min-new-frames 128
        fi
        kill %1; wait; mv $OUT/serve_50061.log $OUT/serve_$a$tag.log ;;
      default|default_gl)
        local model=default
        if [[ $a == default_gl ]]; then  # the same bundle decoded by Griffin-Lim: codec.json without its vocoder
          model=/tmp/default_gl; rm -rf $model; cp -r tts/assets/default $model
          python3 -c "import json, sys; p = sys.argv[1] + '/codec.json'; c = json.load(open(p)); c.pop('vocoder'); json.dump(c, open(p, 'w'))" $model
        fi
        serve $model 50063 9467 $extra
        bench 50063 9467 $a${tag}_service --concurrency $levels --max-new-frames 128 --min-new-frames 128
        kill %1; wait; mv $OUT/serve_50063.log $OUT/serve_$a$tag.log ;;
      tps)
        [[ -d /tmp/s2 ]] || write_s2
        timeout 120 $TTS bench --model /tmp/s2 --device cuda --modes graph --batch-sizes 1,64 --frames 64 \
          --out $OUT/tps 2>&1 | tail -4 ;;
      tar)
        grep -h "captured\|warm-up\|Traceback\|Error" $OUT/serve_*.log 2>/dev/null | head -12  # (before they go)
        (cd $OUT && tar czf /tmp/results.tgz . && find . -type f ! -name '*.json' -delete && mv /tmp/results.tgz .) ;;
      *) echo "unknown action $a"; exit 2 ;;
    esac
  done
  grep -h "captured\|warm-up\|Traceback\|Error" $OUT/serve_*.log 2>/dev/null | head -12  # (none left after tar)
}
run_actions
