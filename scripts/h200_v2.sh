#!/usr/bin/env bash
# Default voice v2 on one H200, over consecutive device calls on one warm machine (each call <= 10 min).
# Run from the repo root through the device tool; writes what comes back under $OUT (<= 8 files).
#
#   CALL=1  carry [".whl", ".carry1"]: the CUDA tests and `tts synthesize --device cuda` (h200_service.sh
#           ACTIONS="tests synth") run in the background while the learned vocoder trains from scratch
#           (h200_voice.sh STEP=vocoder: espeak-ng speaks VOC_UTT clips, 16 processes).
#           .carry1/ holds espeak.tgz (the .espeak/ folder h200_voice.sh describes) and sentences.jsonl.gz
#           (the first lines of training/work/sentences.jsonl: the held-out sentences, then the clips).
#   CALL=2  carry [".carry2", ".whl-voice"]: the v2 model trains from scratch on .carry2/codes_all.tgz
#           (the codes of `corpus.py encode --codes-dir training/work/codes_all` through the shipped
#           codec, paragraphs included) with chunk-length history, while the vocoder goes on from the checkpoint the last
#           call left on this machine (skipped on a fresh machine).
#   CALL=3  carry [".whl-voice"]: both go on from the checkpoints left on this machine.
#   CALL=4  carry [".whl-voice", ".carry1"]: a second stage of the vocoder on a fresh machine: espeak-ng
#           speaks the VOC_UTT clips again and training starts from the bundle's vocoder
#           (train_vocoder.py --init tts/assets/default) with a fresh optimizer and one cosine from
#           VOC_LR over this call (the first stage's call ended with its learning rate at 0.83 of peak).
#   CALL=5  carry [".whl-voice", ".carry1"]: an adversarial stage of the vocoder on a fresh machine, as CALL=4
#           but with the discriminators (train_vocoder.py --adversarial, generator peak rate VOC_LR, default
#           2e-4), while the CUDA tests and `tts synthesize --device cuda` run beside it (as CALL=1).
# Wheels: .whl (h200_service.sh's list) for CALL=1, .whl-voice (h200_voice.sh's: train.py imports the
# text normalizer, which needs num2words; plus phonemizer, dlinfo and espeakng-loader for CALL=5's
# `tts synthesize`) after it; whichever was carried is installed.
# The model's learning-rate schedule spans MODEL_SCHEDULE training seconds over calls 2 and 3, the
# vocoder's VOC_SCHEDULE over its calls (train.py / train_vocoder.py --schedule-seconds); CALL_SECONDS is
# each call's wall time for this script.
set -uo pipefail
W=training/work
CALL=${CALL:?CALL=1, 2, 3, 4 or 5 (see the header)} CALL_SECONDS=${CALL_SECONDS:-560}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
WHEELS=.whl; [[ $CALL == 1 ]] || WHEELS=.whl-voice
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $WHEELS/*.whl \
  || exit 1
mkdir -p $W /tmp/logs
vocoder() {  # the vocoder, new or resumed, for the rest of this call (ARGS: train_vocoder.py's schedule)
  [[ -f $W/vocoder_audio.pt || -f .carry1/espeak.tgz ]] || { echo "vocoder: no clips on this machine, skipped"; return; }
  local args=${*:-"--schedule-seconds ${VOC_SCHEDULE:-1000}"}
  SKIP_PIP=1 STEP=vocoder VOC_UTT=${VOC_UTT:-16000} CALL_SECONDS=$(( CALL_SECONDS - SECONDS )) \
    VOC_ARGS="$args" bash scripts/h200_voice.sh > /tmp/logs/vocoder_call$CALL.log 2>&1
  grep -v '"step"' /tmp/logs/vocoder_call$CALL.log | tail -12
}
unpack_carry1() {  # espeak-ng (.espeak/) and the clips' text list, for the vocoder's speech
  tar xzf .carry1/espeak.tgz && cp .carry1/sentences.jsonl.gz $W/ && rm -f $W/sentences.jsonl
}
tests_beside() {  # the CUDA tests and `tts synthesize --device cuda` in the background (tests_collect waits)
  (SKIP_PIP=1 ACTIONS="tests synth" bash scripts/h200_service.sh > /tmp/logs/service.log 2>&1
   echo "service script exit $?" >> /tmp/logs/service.log) &
}
tests_collect() {
  wait
  cp $OUT/cuda_tests.log $OUT/env.txt /tmp/logs/ 2>/dev/null; rm -f $OUT/cuda_tests.log $OUT/env.txt
  tail -12 /tmp/logs/service.log
}
if [[ $CALL == 4 ]]; then
  unpack_carry1
  vocoder --init tts/assets/default --lr ${VOC_LR:-8e-4}
  cp /tmp/logs/vocoder_call4.log $OUT/ 2>/dev/null
elif [[ $CALL == 5 ]]; then
  unpack_carry1
  tests_beside
  vocoder --init tts/assets/default --adversarial --adv-warmup ${ADV_WARMUP:-300} --lr ${VOC_LR:-2e-4} --log-every 100
  tests_collect
  cp /tmp/logs/vocoder_call5.log $OUT/ 2>/dev/null
  # Only the generator comes back: checkpoint.pt, with the discriminators and both optimizers (~75 MB),
  # is over what a call returns (the first run's last part was left out).
  rm -f $OUT/vocoder.tgz.part-*; tar czf $OUT/vocoder.tgz -C $W --exclude checkpoint.pt vocoder
elif [[ $CALL == 1 ]]; then
  unpack_carry1
  tests_beside
  vocoder
  tests_collect
else
  [[ $CALL == 2 ]] && { tar xzf .carry2/codes_all.tgz -C $W || exit 1; }
  [[ -f $W/vocoder/checkpoint.pt ]] && vocoder > /tmp/logs/vocoder_summary_call$CALL.txt &
  RES=(); [[ $CALL != 2 && -d $W/v2_model ]] && RES=(--resume $W/v2_model)
  LEFT=$(( CALL_SECONDS - SECONDS - 25 ))
  timeout $LEFT python3 training/train.py --data $W/codes_all --codec tts/assets/default --out /tmp/v2_model \
    --size fast --workers 10 --batch-tokens 65536 --lr 1.5e-3 --warmup 300 --max-seconds $(( LEFT - 10 )) \
    --schedule-seconds ${MODEL_SCHEDULE:-900} --history-rate 0.5 --history-frames 320 \
    --full-checkpoint $W/v2_full.pt "${RES[@]}" ${TRAIN_ARGS:-} > /tmp/logs/model_call$CALL.log 2>&1
  grep -E "corpus|model:|resumed|trained|wrote|Error|\"step\": [0-9]*000," /tmp/logs/model_call$CALL.log | cut -c1-400
  rm -rf $W/v2_model && cp -r /tmp/v2_model $W/v2_model && cp /tmp/logs/model_call$CALL.log $W/v2_model/train.log
  tar czf $OUT/v2_model.tgz -C $W v2_model
  wait; cat /tmp/logs/vocoder_summary_call$CALL.txt 2>/dev/null
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > /tmp/logs/gpu.txt
find $OUT -name 'gpu.txt' -delete; mv $OUT/vocoder.log /tmp/logs/ 2>/dev/null
tar czf $OUT/logs.tgz -C /tmp logs && ls -la $OUT
