#!/usr/bin/env bash
# The service at engine speed, on one H200: the runs behind BENCHMARKS.md's service tables.
# Run from the repo root through the device tool with `carry: [".whl"]` (.whl: the wheels the GPU image
# lacks: soundfile, cffi, pycparser, grpcio 1.85 + health + reflection, protobuf 7, num2words, docopt,
# phonemizer, dlinfo, espeakng-loader). Writes everything under $OUT.
#   STEP=check   the CUDA tests (graphs, batched DAC and default-codec decoders), the DAC codec-stage
#                micro-benchmark, then the S2-Pro service benchmark (c = 1, 16, 64; 128 frames per request)
#   STEP=s2      the DAC graph-replay diagnosis (scripts/dac_graph_diag.py); S2-Pro service with the
#                codec in float32 and in bfloat16 at c = 1, 16, 64; the reference modes at c = 16 (bf16)
#   STEP=final   S2-Pro service (float32 codec) c = 1, 16, 64 and the reference modes at c = 16; the
#                default voice's service and `tts synthesize --device cuda`; S2-Pro with the bf16 codec
#                at c = 16, 64; `tts bench` graph batch 1; the batched-DAC CUDA tests
#   STEP=default the default voice on the GPU: service c = 1, 16, 64, `tts synthesize --device cuda` RTF;
#                then `tts bench` graph batch 1 of S2-Pro (the per-stream reference)
#   STEP=prio    the CUDA tests (stops if one fails); S2-Pro service, float32 codec: the frame steps on a high-priority CUDA stream (c = 1, 16,
#                64, 64) and on the default stream (TTS_STEP_STREAM=default: c = 16, 64, 64), the A/B of
#                the stream priorities
#   STEP=profile S2-Pro service (float32 codec) at c = 1, 64 with the engine thread's phases, and py-spy
#                samples of the server during a second c = 64 level (all threads, then only the GIL
#                holder); `tts bench` graph batch 1 and 64 (the engine alone)
#   STEP=after   the CUDA tests (stops if one fails); S2-Pro service (float32 codec) and the default
#                voice's service at c = 1, 16, 64, 64; `tts synthesize --device cuda` to raw PCM
#   STEP=attn    the CUDA tests (stops if one fails); `tts bench` graph batch 1 and 64 at the served
#                context (32k tokens); S2-Pro service (float32 codec) at c = 1, 16, 64, 64
#   STEP=attn2   S2-Pro service with the bf16 codec (c = 16, 64, 64; the reference modes at c = 16); the
#                default voice's service (c = 1, 16, 64, 64)
#   STEP=prefill the prefill alone and packed, timed and profiled (scripts/profile_prefill.py)
#   STEP=codec   the CUDA tests of the DAC and the graphs (PYTEST_K selects; stops if one fails); the
#                prefill profile; the batched DAC decode with the fused Snake kernels off and on
#                (TTS_FUSED_KERNELS=0 / 1; DAC_BENCH=0 skips it)
#   STEP=service S2-Pro service with the float32 codec (c = 1, 16, 64, 64) and the bfloat16 codec (c = 16,
#                64, 64; SERVICE_BF16=0 skips it); `tts bench` graph batch 1 and 64 at the served context
#                (TPS_BENCH=0 skips it)
#   STEP=last    the CUDA tests of the graphs and the batched codecs (stops if one fails); the default
#                voice's service (c = 1, 16, 64) and `tts synthesize --device cuda` to raw PCM
#   STEP=verify  every CUDA test (stops if one fails); `tts synthesize`'s wall time broken down on the GPU
#                (scripts/profile_synthesize.py); S2-Pro service, float32 codec (c = 1, 16, 64, 64 and the
#                reference modes at c = 16) and bfloat16 codec (c = 16, 64, 64); the default voice's
#                service (c = 1, 16, 64, 64); `tts bench` graph batch 1 and 64
#   STEP=handover the CUDA tests (stops if one fails); `tts synthesize` broken down and run as a user
#                would; the default voice's prefill profiled; its service (c = 1, 16, 64, 64, then a
#                longer c = 64 level with py-spy sampling the GIL holder); S2-Pro service, float32 codec
#                (c = 1, 16, 64, 64); `tts bench` graph batch 1. Everything under $OUT in results.tgz
#   STEP=closing the CUDA tests of the graphs (stops if one fails); `tts synthesize --device cuda` as a user
#                runs it; the default voice's service (c = 1, 16, 64, 64); S2-Pro service, float32 codec
#                (c = 1, 16, 64, 64) and bfloat16 codec (c = 16, 64, 64); `tts bench` graph batch 1
#   STEP=cli     `tts synthesize --device cuda` twice as a user runs it; the default voice's service
#                (c = 1, 16, 64, 64)
#   ACTIONS="..." (no STEP) runs the named actions in order instead of a STEP, so that a new run composes
#                these rather than adding a step: tests (every CUDA test; stops if one fails), accuracy
#                (bfloat16 DAC decode vs float32, and fish-speech's way: autocast), synth (`tts synthesize
#                --device cuda` twice), s2_fp32 / s2_bf16 / default (the service at LEVELS, default
#                1,16,64,64), refs (the reference modes at c = 16, float32 codec), tps (`tts bench` graph
#                batch 1 and 64), tar (everything under $OUT into results.tgz, keeping the JSON files).
#                A service action may carry server options after a slash, commas for spaces, and its files
#                get a tag from them: s2_fp32/--prefill-graphs,off writes s2_fp32_prefillgraphs_off_service.json
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export XDG_DATA_HOME=/tmp/xdg  # registered voices
TTS="python3 -m tts.cli"
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
        grep -Eq "failed|error" $OUT/cuda_tests.log && exit 1 ;;
      accuracy)
        timeout 120 python3 benchmarks/codec/dac_batched.py --device cuda --accuracy-only --out $OUT/dac_accuracy.json \
          2>&1 | grep accuracy ;;
      synth) synthesize_twice ;;
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
      default)
        serve default 50063 9467 $extra
        bench 50063 9467 default${tag}_service --concurrency $levels --max-new-frames 128 --min-new-frames 128
        kill %1; wait; mv $OUT/serve_50063.log $OUT/serve_default$tag.log ;;
      tps)
        [[ -d /tmp/s2 ]] || write_s2
        timeout 120 $TTS bench --model /tmp/s2 --device cuda --modes graph --batch-sizes 1,64 --frames 64 \
          --out $OUT/tps 2>&1 | tail -4 ;;
      tar) (cd $OUT && tar czf /tmp/results.tgz . && find . -type f ! -name '*.json' -delete && mv /tmp/results.tgz .) ;;
      *) echo "unknown action $a"; exit 2 ;;
    esac
  done
  grep -h "captured\|warm-up\|Traceback\|Error" $OUT/serve_*.log 2>/dev/null | head -12
}
if [[ -n ${ACTIONS:-} ]]; then run_actions; exit; fi

STEP=${STEP:-check}
if [[ $STEP == check ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py tests/test_dac_batched.py \
    tests/test_melvq_batched.py -s 2>&1 | tail -25 | tee $OUT/cuda_tests.log
  timeout 130 python3 benchmarks/codec/dac_batched.py --device cuda --batches 1,16,64 --frames 4,16 \
    --cudnn-benchmark on --time-budget 110 --out $OUT/dac_batched.json 2>&1 | tail -30
  write_s2
  serve /tmp/s2 50061 9465
  bench 50061 9465 s2_service_fp32 --concurrency 1,16,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait; grep -v "^INFO service.server: request" $OUT/serve_50061.log | tail -5
fi
if [[ $STEP == s2 ]]; then
  timeout 120 python3 scripts/dac_graph_diag.py > $OUT/dac_graph_diag.txt 2>&1; tail -3 $OUT/dac_graph_diag.txt
  write_s2
  serve /tmp/s2 50061 9465
  bench 50061 9465 s2_service_fp32 --concurrency 1,16,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  serve /tmp/s2 50062 9466 --codec-dtype bfloat16
  bench 50062 9466 s2_service_bf16 --concurrency 1,16,64 --max-new-frames 128 --min-new-frames 128
  for mode in repeated distinct registered; do
    bench 50062 9466 s2_reference_$mode --concurrency 16 --requests 64 --max-new-frames 128 --min-new-frames 128 --reference $mode
  done
  kill %1; wait
  tail -n 3 $OUT/serve_50061.log $OUT/serve_50062.log
fi
if [[ $STEP == final ]]; then
  write_s2
  serve /tmp/s2 50061 9465
  bench 50061 9465 s2_service_fp32 --concurrency 1,16,64 --max-new-frames 128 --min-new-frames 128
  for mode in repeated distinct registered; do
    bench 50061 9465 s2_reference_$mode --concurrency 16 --requests 64 --max-new-frames 128 --min-new-frames 128 --reference $mode
  done
  kill %1; wait
  serve default 50063 9467
  bench 50063 9467 default_service --concurrency 1,16,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  for s in 1 2 3; do timeout 60 $TTS synthesize "Please call Stella and ask her to bring these things." --device cuda --seed $s -o /tmp/x$s.wav 2>&1 | tail -1; done
  serve /tmp/s2 50062 9466 --codec-dtype bfloat16
  bench 50062 9466 s2_service_bf16 --concurrency 16,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  timeout 100 $TTS bench --model /tmp/s2 --device cuda --modes graph --batch-sizes 1 --frames 64 --out $OUT/tps 2>&1 | tail -3
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_dac_batched.py -s 2>&1 | tail -4 | tee $OUT/cuda_dac_tests.log
fi
if [[ $STEP == default ]]; then
  serve default 50063 9467
  bench 50063 9467 default_service --concurrency 1,16,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  for s in 1 2 3; do timeout 60 $TTS synthesize "Please call Stella and ask her to bring these things." --device cuda --seed $s -o /tmp/x$s.wav 2>&1 | tail -1; done
  write_s2
  timeout 120 $TTS bench --model /tmp/s2 --device cuda --modes graph --batch-sizes 1 --frames 64 --out $OUT/tps 2>&1 | tail -3
fi
if [[ $STEP == prio ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda tests/ 2>&1 | tail -8 | tee $OUT/cuda_tests.log
  grep -q "failed" $OUT/cuda_tests.log && exit 1
  write_s2
  serve /tmp/s2 50061 9465
  bench 50061 9465 s2_service_fp32_step_stream_high --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  export TTS_STEP_STREAM=default; serve /tmp/s2 50062 9466
  bench 50062 9466 s2_service_fp32_step_stream_default --concurrency 16,64,64 --max-new-frames 128 --min-new-frames 128; unset TTS_STEP_STREAM
  kill %1; wait
  grep -h "captured\|SERVING\|Traceback\|Error" $OUT/serve_*.log | head -20
fi
if [[ $STEP == after ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py tests/test_dac_batched.py \
    tests/test_melvq_batched.py 2>&1 | tail -6 | tee $OUT/cuda_tests.log
  grep -Eq "failed|error" $OUT/cuda_tests.log && exit 1
  write_s2
  serve /tmp/s2 50061 9465
  bench 50061 9465 s2_service_fp32 --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  serve default 50063 9467
  bench 50063 9467 default_service --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  for s in 1 2 3; do timeout 60 $TTS synthesize "Please call Stella and ask her to bring these things." --device cuda --seed $s -o /tmp/x$s.pcm 2>&1 | tail -1; done
fi
if [[ $STEP == profile ]]; then
  write_s2
  serve /tmp/s2 50061 9465
  pid=$(pgrep -f "serve --model /tmp/s2" | head -1)
  bench 50061 9465 s2_phases --concurrency 1,64 --max-new-frames 128 --min-new-frames 128
  (sleep 8; timeout 30 /tmp/site/bin/py-spy dump --pid $pid > $OUT/pyspy_dump.txt 2>&1
   timeout 30 /tmp/site/bin/py-spy record --pid $pid --duration 10 --rate 200 --threads --idle --format raw \
     -o $OUT/pyspy_all.txt > $OUT/pyspy_record.log 2>&1
   timeout 30 /tmp/site/bin/py-spy record --pid $pid --duration 8 --rate 200 --threads --gil --format raw \
     -o $OUT/pyspy_gil.txt >> $OUT/pyspy_record.log 2>&1) &
  bench 50061 9465 s2_phases_spied --concurrency 64 --warmup 0 --max-new-frames 128 --min-new-frames 128
  wait %2 2>/dev/null; kill %1; wait
  tail -3 $OUT/pyspy_record.log
  timeout 150 $TTS bench --model /tmp/s2 --device cuda --modes graph --batch-sizes 1,64 --frames 64 --out $OUT/tps 2>&1 | tail -4
fi
if [[ $STEP == s2only ]]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py -k engine_loop 2>&1 | grep -v "^  " | tail -40 > $OUT/engine_loop_test.log
  write_s2
  serve /tmp/s2 50061 9465
  bench 50061 9465 s2_service_fp32 --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
fi
if [[ $STEP == attn ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py 2>&1 \
    | tail -6 | tee $OUT/cuda_tests.log
  grep -Eq "failed|error" $OUT/cuda_tests.log && exit 1
  timeout 150 $TTS bench --model s2-pro-shape --device cuda --modes graph --batch-sizes 1,64 --frames 64 --out $OUT/tps 2>&1 | tail -4
  write_s2
  serve /tmp/s2 50061 9465
  bench 50061 9465 s2_service_fp32 --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  grep -h "SERVING\|Traceback\|Error" $OUT/serve_*.log | head -20
fi
if [[ $STEP == attn2 ]]; then
  write_s2
  serve /tmp/s2 50064 9468 --codec-dtype bfloat16
  bench 50064 9468 s2_service_bf16 --concurrency 16,64,64 --max-new-frames 128 --min-new-frames 128
  for mode in repeated distinct registered; do
    bench 50064 9468 s2_reference_$mode --concurrency 16 --requests 64 --max-new-frames 128 --min-new-frames 128 --reference $mode
  done
  kill %1; wait
  serve default 50063 9467
  bench 50063 9467 default_service --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  grep -h "SERVING\|Traceback\|Error" $OUT/serve_*.log | head -20
fi
if [[ $STEP == prefill ]]; then
  timeout 300 python3 scripts/profile_prefill.py --model s2-pro-shape --device cuda --tokens 64,128,256 \
    --packed 16 --out $OUT/prefill.txt 2>&1 | grep -v USDT | tail -8
fi
if [[ $STEP == codec ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_dac_batched.py tests/test_cuda_graphs.py -s \
    -k "${PYTEST_K:-cuda or not cuda}" 2>&1 | grep -v "^  " | tail -30 | tee $OUT/cuda_tests.log
  grep -Eq "failed|error" $OUT/cuda_tests.log && exit 1
  timeout 150 python3 scripts/profile_prefill.py --model s2-pro-shape --device cuda --tokens 64,128,256 \
    --packed 16 --out $OUT/prefill.txt 2>&1 | grep -v USDT | tail -12
  [[ ${DAC_BENCH:-1} == 0 ]] && exit 0
  TTS_FUSED_KERNELS=0 timeout 90 python3 benchmarks/codec/dac_batched.py --device cuda --batches 16,64 --frames 16 \
    --cudnn-benchmark on --iters 15 --variant-seconds 2 --time-budget 70 --out $OUT/dac_unfused.json 2>&1 | tail -12
  TTS_FUSED_KERNELS=1 timeout 120 python3 benchmarks/codec/dac_batched.py --device cuda --batches 16,64 --frames 16 \
    --cudnn-benchmark both --iters 15 --variant-seconds 2 --time-budget 100 --out $OUT/dac_fused.json 2>&1 | tail -20
fi
if [[ $STEP == service ]]; then
  if [[ -n ${PYTEST_K:-} ]]; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py tests/test_dac_batched.py \
      -k "$PYTEST_K" 2>&1 | grep -v "^  " | tail -8 | tee $OUT/cuda_tests.log
    grep -Eq "failed|error" $OUT/cuda_tests.log && exit 1
  fi
  write_s2
  serve /tmp/s2 50061 9465
  bench 50061 9465 s2_service_fp32 --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  if [[ ${SERVICE_BF16:-1} == 1 ]]; then
    serve /tmp/s2 50064 9468 --codec-dtype bfloat16
    bench 50064 9468 s2_service_bf16 --concurrency 16,64,64 --max-new-frames 128 --min-new-frames 128
    kill %1; wait
  fi
  grep -h "SERVING\|Traceback\|Error" $OUT/serve_*.log | head -20
  [[ ${TPS_BENCH:-1} == 0 ]] && exit 0
  timeout 120 $TTS bench --model /tmp/s2 --device cuda --modes graph --batch-sizes 1,64 --frames 64 --out $OUT/tps 2>&1 | tail -4
fi
if [[ $STEP == last ]]; then
  timeout 110 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py tests/test_melvq_batched.py 2>&1 \
    | grep -v "^  " | tail -8 | tee $OUT/cuda_tests.log
  grep -Eq "failed|error" $OUT/cuda_tests.log && exit 1
  serve default 50063 9467
  bench 50063 9467 default_service --concurrency 1,16,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  grep -h "warm-up\|captured\|Traceback\|Error" $OUT/serve_*.log | head -8
  for s in 1 2; do timeout 30 $TTS synthesize "Please call Stella and ask her to bring these things." --device cuda --seed $s -o /tmp/x$s.pcm 2>&1 | tail -1; done
fi
if [[ $STEP == verify ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py tests/test_dac_batched.py \
    tests/test_melvq_batched.py 2>&1 | grep -v "^  " | tail -12 | tee $OUT/cuda_tests.log
  grep -Eq "failed|error" $OUT/cuda_tests.log && exit 1
  timeout 90 python3 scripts/profile_synthesize.py --model default --device cuda --out $OUT/synth_profile.txt 2>&1 \
    | grep -v "USDT\|gpuGet" | head -8
  write_s2
  serve /tmp/s2 50061 9465
  bench 50061 9465 s2_service_fp32 --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  for mode in repeated distinct registered; do
    bench 50061 9465 s2_reference_$mode --concurrency 16 --requests 64 --max-new-frames 128 --min-new-frames 128 --reference $mode
  done
  kill %1; wait
  serve /tmp/s2 50064 9468 --codec-dtype bfloat16
  bench 50064 9468 s2_service_bf16 --concurrency 16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  serve default 50063 9467
  bench 50063 9467 default_service --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  grep -h "captured\|warm-up\|SERVING\|Traceback\|Error" $OUT/serve_*.log | head -20
  timeout 120 $TTS bench --model /tmp/s2 --device cuda --modes graph --batch-sizes 1,64 --frames 64 --out $OUT/tps 2>&1 | tail -4
fi
if [[ $STEP == handover ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py tests/test_dac_batched.py \
    tests/test_melvq_batched.py 2>&1 | grep -v "^  " | tail -6 | tee $OUT/cuda_tests.log
  grep -Eq "failed|error" $OUT/cuda_tests.log && exit 1
  timeout 90 python3 scripts/profile_synthesize.py --model default --device cuda --out $OUT/synth_profile.txt 2>&1 \
    | grep -v "USDT\|gpuGet\|warn" | head -7
  for s in 1 2; do timeout 60 $TTS synthesize "Please call Stella and ask her to bring these things." --device cuda --seed $s -o /tmp/x$s.pcm 2>&1 | tail -1; done
  timeout 90 python3 scripts/profile_prefill.py --model default --device cuda --tokens 64 --packed 4 --out $OUT/prefill_default.txt 2>&1 | grep -v USDT | tail -4
  serve default 50063 9467
  pid=$(pgrep -f "serve --model default" | head -1)
  bench 50063 9467 default_service --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  (sleep 3; timeout 30 /tmp/site/bin/py-spy record --pid $pid --duration 8 --rate 250 --threads --gil --format raw \
     -o $OUT/pyspy_gil_default.txt > $OUT/pyspy_record.log 2>&1) &
  bench 50063 9467 default_service_spied --concurrency 64 --requests 768 --warmup 0 --max-new-frames 128 --min-new-frames 128
  wait %2 2>/dev/null; kill %1; wait
  tail -2 $OUT/pyspy_record.log
  write_s2
  serve /tmp/s2 50061 9465
  bench 50061 9465 s2_service_fp32 --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  grep -h "captured\|warm-up\|Traceback\|Error" $OUT/serve_*.log | head -12
  timeout 100 $TTS bench --model /tmp/s2 --device cuda --modes graph --batch-sizes 1 --frames 64 --out $OUT/tps 2>&1 | tail -3
  (cd $OUT && tar czf /tmp/results.tgz . && find . -type f ! -name '*.json' -delete && mv /tmp/results.tgz .)
fi
if [[ $STEP == closing ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py 2>&1 | grep -v "^  " | tail -4 \
    | tee $OUT/cuda_tests.log
  grep -Eq "failed|error" $OUT/cuda_tests.log && exit 1
  synthesize_twice
  serve default 50063 9467
  bench 50063 9467 default_service --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  write_s2
  serve /tmp/s2 50061 9465
  bench 50061 9465 s2_service_fp32 --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  serve /tmp/s2 50064 9468 --codec-dtype bfloat16
  bench 50064 9468 s2_service_bf16 --concurrency 16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  grep -h "captured\|warm-up\|Traceback\|Error" $OUT/serve_*.log | head -12
  timeout 100 $TTS bench --model /tmp/s2 --device cuda --modes graph --batch-sizes 1 --frames 64 --out $OUT/tps 2>&1 | tail -3
  (cd $OUT && tar czf /tmp/results.tgz . && find . -type f ! -name '*.json' -delete && mv /tmp/results.tgz .)
fi
if [[ $STEP == cli ]]; then
  synthesize_twice
  serve default 50063 9467
  bench 50063 9467 default_service --concurrency 1,16,64,64 --max-new-frames 128 --min-new-frames 128
  kill %1; wait
  grep -h "captured\|warm-up\|Traceback\|Error" $OUT/serve_*.log | head -6
fi
