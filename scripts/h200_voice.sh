#!/usr/bin/env bash
# Default-voice pipeline on one GPU machine (issue 5). Run from the repo root through the device tool.
#   STEP=corpus  carry [".whl-voice", ".espeak", "training/work/sentences.jsonl.gz"]: espeak-ng speech -> log-mel
#                shards (16 processes), the k-means codec and two learned codecs, codes of every clip
#                through each; the CUDA tests run alongside. Brings back the codecs and codes.
#   STEP=codec   no extra carry, on the machine STEP=corpus left warm: trains one learned codec longer,
#                encodes every clip with it, brings back codec + codes as a split tarball.
#   STEP=train_vq3  carry [".whl-voice", "training/work/carry", "training/work/codec_vq3_meta"]: the
#                shipped run: unpacks carry/codes_vq3.tgz and trains the model (TRAIN_ARGS extra flags)
#                while the CUDA tests run; brings back the weights.
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
if [[ ${STEP} == corpus ]]; then
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
else
  timeout 590 python3 training/train.py --data ${DATA:-$W/codes} --codec ${CODEC:-$W/codec} --out $OUT/model --workers 12 ${TRAIN_ARGS:-} 2>&1 \
    | tee $OUT/train.log | grep -E "corpus|model|trained|wrote|\"step\": [0-9]*000," 
fi
