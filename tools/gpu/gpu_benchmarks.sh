#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md, on one machine with a CUDA GPU.
#
# Needs the project installed with CUDA PyTorch (`pip install -e '.[dev]'`); `loop_guard`'s scoring needs
# the tools extra (`pip install -e '.[tools]'`). Run from the repository root:
#
#   ACTIONS="tests tps s2_fp32 s2_bf16 default" bash tools/gpu/gpu_benchmarks.sh
#
# Actions, run in the order given:
#   tests       every CUDA test (stops the script if one fails)
#   tps         `tts bench`, S2-Pro shape with random weights, eager and graph, batches 1, 4, 16, 64
#   kv          `tts bench`, S2-Pro shape, graph, batches 1, 64, 128, 256 (KV blocks taken as requests
#               grow; buckets past 64), and the max batch `tts serve --max-batch auto` picks on this card
#   checkpoint  a real-format S2-Pro checkpoint with random weights: write it, `tts info`, `tts bench`
#   s2_fp32, s2_bf16, default
#               the service (S2-Pro with the float32 or the bfloat16 codec, or the default voice) under
#               `tts bench-server` at LEVELS (default 1,16,64,64), 128 frames per request, on a fresh server
#   sessions    the voice-agent benchmark: S2-Pro (bfloat16 codec) serving SESSIONS (default 64) concurrent
#               SynthesizeSession calls, each fed by a synthetic LLM at WPS (default 15) words/s, 64 frames
#               per chunk (`tts bench-server --sessions`: clause -> first audio, underruns, cancel -> silence,
#               prefill tokens per chunk)
#   ramp        how many concurrent S2-Pro streams stay real time (`tts bench-server --ramp`): S2-Pro, bfloat16
#               codec, a server of --max-batch 256 --max-waiting 512; levels of 4 x C requests of 128 frames
#               from RAMP_START (default 64) doubling to RAMP_MAX (default 512), then bisected to RAMP_STEP
#               (default 16) streams; a level is real time with no playback underrun, TTFA p95 <= 300 ms and
#               no error; a stream sends its next request when its last one's audio has played (RAMP_BENCH:
#               more `tts bench-server` options, e.g. "--ramp-pacing none" for the closed loop, or
#               "--chunk-frames 4" for chunks of 4, 4, 4, ... frames). Reports the most real-time streams, or that the server's max batch, queue or KV
#               pool stopped the ramp first (ramp.json: `ramp.real_time_streams`, `ramp.stopped_by`)
#   refs        the reference-clip modes (repeated, distinct, registered) at 16 clients, S2-Pro, float32 codec
#   dac         the batched DAC decode timed (graph replay) and its bfloat16 accuracy
#   prefill     the S2-Pro prefill, alone and packed, timed cold and warm (tools/profile/profile_prefill.py),
#               and its graphed passes by prompts packed, alone and beside the codec's decode calls
#               (tools/profile/prefill_beside_codec.py)
#   loop_guard  the default voice's frame step with and without its aligner, and the held-out passages
#               read with the guard on and off (scored where the tools extra is installed)
#   synth       `tts synthesize --device cuda` with each --graphs mode, each in a fresh process, timed
#               as a user sees it
#   fp8         weight-only fp8 / int8 linear layers (`--weights`, tts.model.quant), S2-Pro shape: the CUDA
#               tests of tests/test_quant.py; accuracy against bf16 (per-layer error, top-1 agreement) and
#               the kernel's GB/s per layer shape (tts_tools.quant_check); `tts bench` graph batches 1 and
#               8 at a 4,096-token context for bf16, fp8, int8 (frames/s, peak memory); the default voice's
#               accuracy on its preset voices; WER of the default voice with and without fp8 where the
#               tools extra and its ASR model are at hand (about 4 minutes in all; FP8_QUICK=1 skips the
#               bf16-vs-fp32 baseline and the kernel sweep)
# A service action may carry server options after a slash, commas for spaces; its files get a tag from
# them: `default/--loop-guard,off` writes default_loopguard_off.json.
#
# Environment: OUT (results folder, default gpu-results), LEVELS, SESSIONS, WPS, RAMP_START, RAMP_MAX, RAMP_STEP,
# PORT (gRPC, default 50061; the metrics port is PORT + 1), S2_DIR (where the S2-Pro checkpoint is written,
# default /tmp/tts-s2-pro).
set -uo pipefail
[[ -n ${ACTIONS:-} ]] || { echo "usage: ACTIONS=\"tests tps s2_fp32 ...\" bash $0 (see the header)"; exit 2; }
OUT=${OUT:-gpu-results}
PORT=${PORT:-50061}
MPORT=$((PORT + 1))
S2_DIR=${S2_DIR:-/tmp/tts-s2-pro}
LEVELS=${LEVELS:-1,16,64,64}
export PYTHONUNBUFFERED=1 XDG_DATA_HOME=${XDG_DATA_HOME:-/tmp/tts-gpu-benchmarks-data}  # registered voices
mkdir -p "$OUT"
SERVER_PID=""

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, grpc; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'grpc', grpc.__version__)" | tee -a "$OUT/env.txt"
(git log --oneline -1 2>/dev/null || true) | tee -a "$OUT/env.txt"

stop_server() {  # the server this script started, and only it
  if [[ -n $SERVER_PID ]]; then kill -TERM "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=""; fi
}
trap stop_server EXIT

serve() {  # serve NAME MODEL EXTRA...: start `tts serve` and wait until gRPC health says SERVING
  local name=$1 model=$2; shift 2
  tts serve --model "$model" --device cuda --max-batch 64 --max-waiting 256 --graphs startup --port "$PORT" \
    --metrics-port "$MPORT" --http-port -1 "$@" > "$OUT/serve_$name.log" 2>&1 &
  SERVER_PID=$!
  python3 - "$PORT" "$SERVER_PID" <<'PY' || { echo "server $name did not come up: $OUT/serve_$name.log"; exit 1; }
import os, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
port, pid, t0 = sys.argv[1], sys.argv[2], time.time()
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
while time.time() - t0 < 600 and os.path.exists(f"/proc/{pid}"):
    try:
        status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
        if status == health_pb2.HealthCheckResponse.SERVING:
            print(f"server on :{port} SERVING after {time.time() - t0:.1f} s")
            sys.exit(0)
    except grpc.RpcError:
        pass
    time.sleep(0.5)
sys.exit(1)
PY
}

bench() {  # bench NAME ARGS...: `tts bench-server` against the running server
  local name=$1; shift
  tts bench-server --server "127.0.0.1:$PORT" --metrics-url "http://127.0.0.1:$MPORT/metrics" --timeout 120 \
    --json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.txt"
}

write_s2() {  # the S2-Pro real-format random checkpoint
  [[ -f $S2_DIR/config.json ]] || tts write-checkpoint --shape s2-pro --out "$S2_DIR" | tail -1
}

for spec in $ACTIONS; do
  action=${spec%%/*}; extra=(); tag=""
  if [[ $spec == */* ]]; then
    opts=${spec#*/}; read -r -a extra <<< "${opts//,/ }"
    tag=_$(echo "${extra[*]}" | tr -d '-' | tr ' ' '_')
  fi
  echo "== $spec ($(date +%T))"
  case $action in
    tests)
      python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_graphs.py tests/test_dac_batched.py \
        tests/test_melvq_batched.py tests/test_engine_loop.py tests/test_quant.py tests/test_packed_extend.py \
        2>&1 | tee "$OUT/cuda_tests.log" | tail -5
      [[ ${PIPESTATUS[0]} -eq 0 ]] || { echo "CUDA tests failed: $OUT/cuda_tests.log"; exit 1; } ;;
    tps)
      tts bench --model s2-pro-shape --device cuda --batch-sizes 1,4,16,64 --frames 64 --out "$OUT/tps" 2>&1 | tail -12 ;;
    kv)
      tts bench --model s2-pro-shape --device cuda --modes graph --frames 64 --warmup-frames 32 \
        --batch-sizes 1,64,128,256 --out "$OUT/kv" 2>&1 | tail -8
      python3 -c "
import torch
from tts.engine.engine import max_batch_for_memory, kv_bytes_per_token
from tts.model.shapes import build_random_model, shape_config
m = build_random_model(shape_config('s2-pro-shape'), 'cuda', torch.bfloat16)
print('free GiB', round(torch.cuda.mem_get_info()[0] / 2**30, 1), 'KV bytes/token', kv_bytes_per_token(m),
      'auto max batch', max_batch_for_memory(m))
" | tee "$OUT/kv_auto.txt" ;;
    checkpoint)
      write_s2
      tts info --model "$S2_DIR" --device cuda | tee "$OUT/checkpoint_info.txt"
      tts bench --model "$S2_DIR" --device cuda --modes graph --batch-sizes 1,64 --frames 32 \
        --out "$OUT/checkpoint_tps" 2>&1 | tail -4 ;;
    s2_fp32|s2_bf16|refs)
      write_s2
      dtype=float32; [[ $action == s2_bf16 ]] && dtype=bfloat16
      serve "$action$tag" "$S2_DIR" --codec-dtype "$dtype" "${extra[@]}"
      if [[ $action == refs ]]; then
        bench "refs_none$tag" --concurrency 16 --requests 64 --max-new-frames 128 --min-new-frames 128
        for mode in repeated distinct registered; do
          bench "refs_$mode$tag" --concurrency 16 --requests 64 --max-new-frames 128 --min-new-frames 128 --reference $mode
        done
      else
        bench "$action$tag" --concurrency "$LEVELS" --max-new-frames 128 --min-new-frames 128
      fi
      stop_server ;;
    sessions)
      write_s2
      n=${SESSIONS:-64}
      serve "sessions$tag" "$S2_DIR" --codec-dtype bfloat16 --max-batch $((n * 2)) --max-sessions "$n" "${extra[@]}"
      bench "sessions_${n}$tag" --sessions "$n" --words-per-second "${WPS:-15}" --max-new-frames 64 \
        --session-spread "${SESSION_SPREAD:-0}" \
        --min-new-frames 64 --seed 1
      stop_server ;;
    ramp)
      write_s2
      serve "ramp$tag" "$S2_DIR" --codec-dtype bfloat16 --max-batch 256 --max-waiting 512 "${extra[@]}"
      bench "ramp$tag" --ramp --ramp-start "${RAMP_START:-64}" --ramp-max "${RAMP_MAX:-512}" \
        --ramp-step "${RAMP_STEP:-16}" --ramp-rounds "${RAMP_ROUNDS:-4}" --max-new-frames 128 --min-new-frames 128 \
        ${RAMP_BENCH:-}
      stop_server ;;
    default)
      serve "default$tag" default "${extra[@]}"
      bench "default$tag" --concurrency "$LEVELS" --max-new-frames 128 --min-new-frames 128
      stop_server ;;
    dac)
      python3 tools/microbench/dac_batched.py --device cuda --batches 1,16,64 --frames 4,16 --cudnn-benchmark on \
        --out "$OUT/dac_batched.json" 2>&1 | tail -20
      python3 tools/microbench/dac_batched.py --device cuda --accuracy-only --out "$OUT/dac_accuracy.json" 2>&1 | tail -4 ;;
    prefill)
      python3 tools/profile/profile_prefill.py --model s2-pro-shape --device cuda --tokens 64,128,256 --packed 16 \
        --out "$OUT/prefill.txt" 2>&1 | tail -12
      python3 tools/profile/prefill_beside_codec.py --out "$OUT/prefill_beside_codec.json" 2>&1 | tail -18 ;;
    loop_guard)
      python3 tools/gpu/loop_guard_gpu.py bench --device cuda --out "$OUT/loop_guard_step.json" | tail -8
      for g in on off; do
        python3 tools/gpu/loop_guard_gpu.py speak --device cuda --seeds 0,1 --loop-guard $g \
          --out "$OUT/long_$g.npz" > "$OUT/long_$g.log" 2>&1
        tail -2 "$OUT/long_$g.log"
      done
      if python3 -c "import faster_whisper, jiwer" 2>/dev/null; then
        python3 tools/gpu/loop_guard_gpu.py score "$OUT/long_on.npz" "$OUT/long_off.npz" | tee "$OUT/long_scored.txt"
      else
        echo "(the tools extra is not installed: score the readings with tools/gpu/loop_guard_gpu.py score)"
      fi ;;
    synth)
      text="Please call Stella and ask her to bring these things."
      # A pip install writes Python's byte code; an image without it (or with PYTHONDONTWRITEBYTECODE)
      # compiles torch's sources in every process, seconds a user never pays: cache it aside first.
      (
        unset PYTHONDONTWRITEBYTECODE
        export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/tts-gpu-pycache}
        python3 -m compileall -q -j 0 "$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')" \
          >/dev/null 2>&1
        tts synthesize "$text" --device cuda --seed 1 -o /tmp/tts-gpu-warm.pcm 2>&1 | tail -1  # (fills caches)
        for g in startup lazy off startup lazy off; do
          t0=$(date +%s.%N)
          tts synthesize "$text" --device cuda --seed 1 --graphs $g -o /tmp/tts-gpu-synth.pcm 2>&1 | tail -1
          echo "graphs $g: whole command $(python3 -c "import time; print(round(time.time() - $t0, 2))") s" \
            | tee -a "$OUT/synth.txt"
        done
      ) ;;
    fp8)
      python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_quant.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -3
      sweep=(--baseline --kernel-bench --sweep); [[ -n ${FP8_QUICK:-} ]] && sweep=()  # (FP8_QUICK=1: ~3 min)
      python3 -m tts_tools.quant_check --model s2-pro-shape --device cuda --weights fp8 "${sweep[@]}" \
        --json "$OUT/fp8_accuracy.json" 2>&1 | tee "$OUT/fp8_accuracy.txt" | tail -16
      python3 -m tts_tools.quant_check --model s2-pro-shape --device cuda --weights int8 \
        --json "$OUT/int8_accuracy.json" 2>&1 | tee "$OUT/int8_accuracy.txt" | tail -3
      for w in fp8 int8; do  # the trained default voice on its preset voices' real speech codes
        python3 -m tts_tools.quant_check --model default --device cuda --weights $w --inputs voices --baseline \
          --json "$OUT/${w}_accuracy_default.json" 2>&1 | tail -5
      done
      for w in bf16 fp8 int8; do
        wopt=(); [[ $w == bf16 ]] || wopt=(--weights "$w")
        tts bench --model s2-pro-shape --device cuda --modes graph --batch-sizes 1,8 --frames 64 --max-context 4096 \
          "${wopt[@]}" --out "$OUT/tps_$w" 2>&1 | tail -4
      done
      if python3 -c "import faster_whisper, jiwer" 2>/dev/null; then
        for w in bf16 fp8; do
          wopt=(); [[ $w == bf16 ]] || wopt=(--weights "$w")
          timeout 120 tts eval --device cuda --limit 20 --seeds 0,1 "${wopt[@]}" --out "$OUT/wer_$w.json" 2>&1 | tail -3
        done
      else
        echo "(the tools extra is not installed: WER with and without --weights fp8 left for another run)"
      fi ;;
    *) echo "unknown action $action (see the header of $0)"; exit 2 ;;
  esac
done
