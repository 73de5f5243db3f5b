#!/usr/bin/env bash
# Default-voice pipeline on one GPU machine (issue 5). Run from the repo root through the device tool.
#   STEP=check   carry as train_vq3: profiles a training step (training/profile_train.py), runs the CUDA
#                tests and the S2-Pro-shape TPS benchmark.
#   STEP=corpus  carry [".whl-voice", ".espeak", "training/work/sentences.jsonl.gz"]: espeak-ng speech -> log-mel
#                shards (16 processes), the k-means codec and two learned codecs, codes of every clip
#                through each; the CUDA tests run alongside. Brings back the codecs and codes.
#   STEP=codec   no extra carry, on the machine STEP=corpus left warm: trains one learned codec longer,
#                encodes every clip with it, brings back codec + codes as a split tarball.
#   STEP=train2  carry as train_vq3: the compiled training step, model + log back as a split tarball;
#                RESUME=1 continues from tts/assets/default (see the step).
#   STEP=big     carry [".whl-voice", ".espeak", "training/work/sentences.jsonl.gz"]: all 42,137 utterances
#                -> shards -> codes (shipped codec) -> train2's training in the time left; model tarball back.
#   STEP=train_vq3  carry [".whl-voice", "training/work/carry", "training/work/codec_vq3_meta"]: the
#                shipped run: unpacks carry/codes_vq3.tgz and trains the model (TRAIN_ARGS extra flags)
#                while the CUDA tests run; brings back the weights.
#   STEP=vocoder carry [".whl-voice", ".espeak", "training/work/sentences.jsonl.gz", "training/work/vocoder"]:
#                the learned vocoder (training/train_vocoder.py): espeak-ng speaks VOC_UTT clips (16 processes),
#                training continues from training/work/vocoder when it holds parts of an earlier call's
#                vocoder.tgz (join them: cat vocoder.tgz.part-* | tar xz -C training/work), the held-out
#                clips are scored without ASR (no Whisper here); the folder comes back as a split tarball.
#                Over several calls, give every call the same VOC_ARGS="--schedule-seconds S" (S: the calls'
#                training seconds together) so that they make one learning-rate schedule.
#   STEP=train   (default) carry [".whl-voice", "training/work/codes", "training/work/codec"]: trains.
# `.espeak/` holds the espeak-ng binary, the shared libraries it links and espeak-ng-data, copied from
# this machine's Debian packages (the GPU machine has none), English data only; `.whl-voice/` the wheels
# the GPU machine lacks (num2words, docopt, soundfile, cffi, pycparser).
set -uo pipefail
[[ -n ${SKIP_PIP:-} ]] || python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-voice/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=training/work
N=${NUTT:-28000} DEV=${DEV:-cuda}
nvidia-smi 2>/dev/null --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a $OUT/gpu.txt
STEP=${STEP:-train}
if [[ ${STEP} == check ]]; then  # carry [".whl-voice", "training/work/carry", "training/work/codec_vq3_meta"]
  tar xzf $W/carry/codes_vq3.tgz -C $W
  timeout 200 python3 training/profile_train.py --data $W/codes_vq3 --codec $W/codec_vq3_meta --compile 2>&1 | tee $OUT/profile.log
  TTS_TEST_REPORT=$OUT/cuda_report.json timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py > $OUT/cuda_tests.log 2>&1
  tail -3 $OUT/cuda_tests.log
  timeout 150 python3 -m tts.cli.main bench --model s2-pro-shape --device cuda --batch-sizes 1,64 --out $OUT/bench 2>&1 | tail -15
elif [[ ${STEP} == train2 ]]; then  # carry [".whl-voice", "training/work/carry", "training/work/codec_vq3_meta"]
  # The compiled, cuDNN-free training step. RESUME=1 continues from the weights in tts/assets/default
  # (put there from the previous call) and training/work/codec_vq3_meta/train_state.json.
  tar xzf $W/carry/codes_vq3.tgz -C $W
  timeout 60 python3 training/profile_train.py --data $W/codes_vq3 --codec $W/codec_vq3_meta --steps 15 2>&1 \
    | grep -E "loader|step" | tee $OUT/profile.log
  RES=()
  if [[ -n ${RESUME:-} ]]; then
    mkdir -p /tmp/resume && cp tts/assets/default/model*.safetensors* $W/codec_vq3_meta/train_state.json /tmp/resume/
    RES=(--resume /tmp/resume)
  fi
  timeout ${TRAIN_TIMEOUT:-560} python3 training/train.py --data $W/codes_vq3 --codec $W/codec_vq3_meta --out /tmp/model \
    --workers 12 "${RES[@]}" ${TRAIN_ARGS:-} 2>&1 | tee /tmp/model.log | grep -E "corpus|model|trained|wrote|\"step\": [0-9]*000,"
  cp /tmp/model.log /tmp/model/train.log
  tar czf /tmp/model.tgz -C /tmp model && split -b 15M /tmp/model.tgz $OUT/model.tgz.part- && ls -la $OUT
elif [[ ${STEP} == big ]]; then  # carry [".whl-voice", ".espeak", "training/work/sentences.jsonl.gz"]
  # Every utterance of sentences.jsonl (42,137, not the first 28,000), codes through the shipped codec,
  # then train2's training for the rest of the 10-minute call.
  export PATH=$PWD/.espeak/bin:$PATH LD_LIBRARY_PATH=$PWD/.espeak/lib ESPEAK_DATA_PATH=$PWD/.espeak
  [[ -f $W/sentences.jsonl ]] || gunzip -k $W/sentences.jsonl.gz
  python3 training/corpus.py synth --work $W --jobs 16 > $OUT/synth.log 2>&1; tail -1 $OUT/synth.log
  python3 training/corpus.py encode --work $W --codec-dir tts/assets/default --codes-dir $W/codes_all --device $DEV \
    --threads 8 > $OUT/encode.log 2>&1; tail -1 $OUT/encode.log; echo "corpus: $SECONDS s"
  LEFT=$(( ${CALL_SECONDS:-570} - SECONDS ))
  timeout $LEFT python3 training/train.py --data $W/codes_all --codec tts/assets/default --out /tmp/model --workers 12 \
    --max-seconds $(( LEFT - 15 )) ${TRAIN_ARGS:-} 2>&1 | tee /tmp/model.log | grep -E "corpus|model|trained|wrote|\"step\": [0-9]*000,"
  cp /tmp/model.log /tmp/model/train.log
  tar czf /tmp/model.tgz -C /tmp model && split -b 15M /tmp/model.tgz $OUT/model.tgz.part- && ls -la $OUT
elif [[ ${STEP} == corpus ]]; then
  export PATH=$PWD/.espeak/bin:$PATH LD_LIBRARY_PATH=$PWD/.espeak/lib ESPEAK_DATA_PATH=$PWD/.espeak
  espeak-ng --version | tee -a $OUT/gpu.txt
  [[ -f $W/sentences.jsonl ]] || gunzip -k $W/sentences.jsonl.gz
  t0=$(date +%s)
  python3 training/corpus.py synth --work $W --jobs 16 --max-utterances $N > $OUT/synth.log 2>&1
  tail -2 $OUT/synth.log; echo "synth: $(( $(date +%s) - t0 )) s"; du -sh $W/shards
  (TTS_TEST_REPORT=$OUT/cuda_report.json timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py > $OUT/cuda_tests.log 2>&1 &)
  python3 training/train_codec.py --work $W --device $DEV --out $W/codec_vq --max-seconds ${CODEC_SECONDS:-200} --batch 256 --lr 2e-3 > $OUT/codec_vq.log 2>&1 &
  python3 training/train_codec.py --work $W --device $DEV --out $W/codec_vq2 --max-seconds ${CODEC_SECONDS:-200} --batch 256 --lr 2e-3 \
    --channels 384 --decoder-dilations 1,2,4,1 > $OUT/codec_vq2.log 2>&1 &
  python3 training/corpus.py codec --work $W --device $DEV --max-utterances $N > $OUT/codec_km.log 2>&1
  wait
  tail -n 3 $OUT/codec_km.log $OUT/codec_vq.log $OUT/codec_vq2.log
  echo "codecs: $(( $(date +%s) - t0 )) s"
  for c in codec codec_vq codec_vq2; do
    python3 training/corpus.py encode --work $W --codec-dir $W/$c --codes-dir $W/codes${c#codec} --device $DEV --threads 4 \
      --max-utterances $N > $OUT/encode_$c.log 2>&1 &
  done
  wait
  tail -n 1 $OUT/encode_*.log; echo "encode: $(( $(date +%s) - t0 )) s"
  for c in codec codec_vq codec_vq2; do cp -r $W/$c $OUT/$c; cp -r $W/codes${c#codec} $OUT/codes${c#codec}; done
  tail -3 $OUT/cuda_tests.log
elif [[ ${STEP} == codec ]]; then  # one learned codec, longer, on the shards left by STEP=corpus
  t0=$(date +%s)
  python3 training/train_codec.py --work $W --device $DEV --out $W/codec_vq3 --max-seconds ${CODEC_SECONDS:-280} --batch 256 \
    --lr 2e-3 --channels 384 --decoder-dilations 1,2,4,1 2>&1 | tee $OUT/codec_vq3.log | grep -v '"step"'
  echo "codec: $(( $(date +%s) - t0 )) s"
  python3 training/corpus.py encode --work $W --codec-dir $W/codec_vq3 --codes-dir $W/codes_vq3 --device $DEV --threads 8 \
    --max-utterances $N > $OUT/encode_vq3.log 2>&1
  tail -n 1 $OUT/encode_vq3.log; echo "encode: $(( $(date +%s) - t0 )) s"
  tar czf /tmp/vq3.tgz -C $W codec_vq3 codes_vq3 && split -b 15M /tmp/vq3.tgz $OUT/vq3.tgz.part- && ls -la $OUT
elif [[ ${STEP} == train_vq3 ]]; then  # carry [".whl-voice", "training/work/carry", "training/work/codec_vq3_meta"]
  (TTS_TEST_REPORT=$OUT/cuda_report.json timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py > $OUT/cuda_tests.log 2>&1 &)
  tar xzf $W/carry/codes_vq3.tgz -C $W
  timeout ${TRAIN_TIMEOUT:-420} python3 training/train.py --data $W/codes_vq3 --codec $W/codec_vq3_meta --out $OUT/model --workers 12 \
    ${TRAIN_ARGS:-} 2>&1 | tee $OUT/train.log | grep -E "corpus|model|trained|wrote|\"step\": [0-9]*000,"
  sleep 2; tail -3 $OUT/cuda_tests.log
elif [[ ${STEP} == vocoder ]]; then
  export PATH=$PWD/.espeak/bin:$PATH LD_LIBRARY_PATH=$PWD/.espeak/lib ESPEAK_DATA_PATH=$PWD/.espeak
  [[ -f $W/sentences.jsonl ]] || gunzip -k $W/sentences.jsonl.gz
  RES=(); [[ -f $W/vocoder/checkpoint.pt ]] && RES=(--resume)
  LEFT=$(( ${CALL_SECONDS:-570} - SECONDS ))
  timeout $LEFT python3 training/train_vocoder.py --work $W --out $W/vocoder --utterances ${VOC_UTT:-8000} --jobs 16 \
    --batch 64 --max-seconds $(( LEFT - 10 )) --log-every 500 --no-asr "${RES[@]}" ${VOC_ARGS:-} 2>&1 | tee $OUT/vocoder.log
  tar czf /tmp/vocoder.tgz -C $W vocoder && split -b 15M /tmp/vocoder.tgz $OUT/vocoder.tgz.part- && ls -la $OUT
else
  timeout 590 python3 training/train.py --data ${DATA:-$W/codes} --codec ${CODEC:-$W/codec} --out $OUT/model --workers 12 ${TRAIN_ARGS:-} 2>&1 \
    | tee $OUT/train.log | grep -E "corpus|model|trained|wrote|\"step\": [0-9]*000," 
fi
