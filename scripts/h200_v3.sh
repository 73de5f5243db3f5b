#!/usr/bin/env bash
# Default voice, flite teacher (training/corpus.py text --teacher flite), on one H200 in consecutive
# calls on one warm machine: each reads what the one before left, so it must start inside the
# machine's warm window (30 s). Run from the repo root through the device tool, carrying .carry3 (or,
# with CALL=0, the .carry4* parts: below).
#
#   CALL=1  flite speaks the first CODEC_UTT utterances into log-mel shards (16 processes); a learned
#           codec (mel VQ-VAE, the shipped shape and recipe: CODEC_ARGS, default --freeze-encoder) trains
#           on them for CODEC_SECONDS while flite speaks the rest; then every clip is encoded through it.
#           The codec comes back. (Its first run trained the encoder too, and codebook 0 collapsed to a
#           perplexity of 22-43 of 1024: training/RESULTS.md.)
#           (In its second run, CODEC_SECONDS=260, the default since, flite finished speaking only at
#           518 s and the last 4 of 55 shards were not encoded before the call's end:
#           training/runs/v3_flite/calls.txt.)
#   CALL=2  the model trains from scratch on those codes (v2's recipe: chunk-length history for half the
#           examples), alone; DROPOUT (default 0) is train.py's --dropout: the shipped model (v3) used
#           0.1, for the slow head that overfit without it. The model comes back as
#           v3_model_call2.tgz.part-* (folder v3_model_call2/).
#   CALL=3  the model goes on from CALL=2's full checkpoint (v2 trained over two calls: MODEL_SCHEDULE,
#           default 900 s, is the one learning-rate schedule both calls share; give CALL=2 the same), and
#           comes back as v3_model_call3.tgz.part-* (v3_model_call3/). Without dropout the mean of both
#           calls' weights (training/export.py --trained CALL2 CALL3) measured better than either; with
#           DROPOUT=0.1 the weights after CALL=3 did, and ship (RESULTS.md).
#   CALL=4  the vocoder alone, from VOC_INIT's (default: the shipped bundle's; the shipped vocoder
#           started from v2's, carried in the .carry4c part: VOC_INIT=$W/v2voc, training/README.md), on
#           VOC_UTT clips through the new codec (16 flite
#           processes, then training for the rest of the call). Never beside the model: flite processes
#           started with it starved its torch.compile (first step at 276 s), and started after its first
#           step under nice 10 they were still speaking when the call ended (the model's 12 data workers
#           take every core), in both calls that tried it. Alone, with one torch thread per flite
#           worker, it spoke 8,060 clips in 54 s and trained 6,288 steps (training/runs/v5_vocoder_flite/).
#   CALL=0  instead of CALL=1: the codec and codes were made elsewhere (a CPU machine: `corpus.py synth`
#           and `corpus.py encode --codec-dir` a codec an earlier CALL=1 brought back) and arrive as
#           .carry4*/*.txz, each a tar of codec_flite/ and codes_flite/ files. The tracked tree leaves
#           about 20 MB of the 64 MiB a call may carry, so they come in parts: each call (any CALL)
#           unpacks the parts it has not unpacked before, and CALL=0 only does that and lists what is
#           there. A model call needs only codec.json of the codec; the vocoder (CALL=4) needs
#           codec.safetensors too.
# Every call after the first needs the machine CALL=1 (or CALL=0) left warm (the codes live only there);
# CALL=4 needs only the codec from it (CALL=0 carrying .carry4c alone, then CALL=4 carrying .carry3).
#
# .carry3/ (git-ignored; rebuild it as training/README.md says): flite.txz (the flite binary and the
# shared libraries it links, from Debian's flite 2.2: the GPU machine has none), sentences.jsonl.gz
# (`corpus.py text --paragraphs 12000 --teacher flite`, only the fields the stages read) and whl/
# (soundfile, cffi, pycparser, num2words and docopt wheels for the machine's Python 3.12). A model call
# (2, 3) needs only whl/, which a .carry4* part may hold instead; CALL=1 and CALL=4 need the rest of
# .carry3, carried in that call or in an earlier one on the same machine.
set -uo pipefail
W=training/work
CALL=${CALL:?CALL=0, 1, 2, 3 or 4 (see the header)} CALL_SECONDS=${CALL_SECONDS:-560}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $W /tmp/logs
shards() { echo "$(ls $W/codes_flite/codes-*.pt 2>/dev/null | wc -l) code shards (55 for the whole corpus)"; }
PARTS=0  # (a part stays on the warm machine after its call: unpacked once, by its checksum)
for part in .carry4*/*.txz; do
  [[ -f $part ]] || continue
  PARTS=$((PARTS + 1)); sum=$(md5sum < "$part" | cut -c1-32)
  [[ -f $W/.unpacked-$sum ]] || { tar xJf "$part" -C $W && touch $W/.unpacked-$sum; } || exit 1
done
if [[ $CALL == 0 ]]; then
  (( PARTS > 0 )) || { echo "CALL=0: no .carry4*/*.txz carried"; exit 1; }
  du -sh $W/*; shards; exit 0
fi
WHL=$(ls -d .carry3/whl .carry4*/whl 2>/dev/null | head -1)
[[ -f /tmp/site/.installed ]] || { python3 -m pip install -q --upgrade --no-index --no-deps --no-compile \
  --no-cache-dir --target /tmp/site ${WHL:?no whl/ carried}/*.whl && touch /tmp/site/.installed; } || exit 1
if [[ -f .carry3/flite.txz ]]; then  # unpacked where a later call finds them without .carry3
  [[ -d $W/.flite ]] || tar xJf .carry3/flite.txz -C $W || exit 1
  [[ -f $W/sentences.jsonl ]] || gunzip -c .carry3/sentences.jsonl.gz > $W/sentences.jsonl
fi
[[ $CALL == [14] && ! ( -d $W/.flite && -f $W/sentences.jsonl ) ]] && { echo "CALL=$CALL needs .carry3"; exit 1; }
export PATH=$PWD/$W/.flite/bin:$PATH LD_LIBRARY_PATH=$PWD/$W/.flite/lib
left() { echo $(( CALL_SECONDS - SECONDS )); }
if [[ $CALL == 1 ]]; then
  flite -lv
  python3 training/corpus.py synth --work $W --jobs 16 --max-utterances ${CODEC_UTT:-20000} > /tmp/logs/synth1.log 2>&1
  tail -1 /tmp/logs/synth1.log; echo "synth for the codec: $SECONDS s"
  python3 training/corpus.py synth --work $W --jobs 12 > /tmp/logs/synth2.log 2>&1 &
  SYNTH=$!
  python3 training/train_codec.py --work $W --max-shards $(( ${CODEC_UTT:-20000} / 1000 )) --device cuda \
    --out $W/codec_flite --max-seconds ${CODEC_SECONDS:-260} --batch 256 --lr 2e-3 --channels 384 \
    --decoder-dilations 1,2,4,1 ${CODEC_ARGS---freeze-encoder} > /tmp/logs/codec.log 2>&1
  grep -v '"step"' /tmp/logs/codec.log | tail -4; echo "codec: $SECONDS s"
  cp /tmp/logs/codec.log $W/codec_flite/train.log; tar czf $OUT/codec_flite.tgz -C $W codec_flite
  # Encode what is spoken so far while flite finishes, then the rest (encode skips finished shards).
  python3 training/corpus.py encode --work $W --codec-dir $W/codec_flite --codes-dir $W/codes_flite --device cuda \
    --threads 4 > /tmp/logs/encode1.log 2>&1
  wait $SYNTH; tail -1 /tmp/logs/synth2.log; echo "synth, all: $SECONDS s"
  timeout $(( $(left) - 5 )) python3 training/corpus.py encode --work $W --codec-dir $W/codec_flite \
    --codes-dir $W/codes_flite --device cuda --threads 8 > /tmp/logs/encode2.log 2>&1
  tail -1 /tmp/logs/encode2.log; ls $W/codes_flite | wc -l; echo "encode: $SECONDS s"
else
  # A model call needs the codes and the codec's codec.json; the vocoder needs only the codec, weights too.
  if [[ $CALL == 4 ]]; then
    [[ -f $W/codec_flite/codec.safetensors ]] \
      || { echo "CALL=4 needs the codec's weights (codec.safetensors: CALL=1, or the .carry4c part)"; exit 1; }
  else
    [[ -f $W/codec_flite/codec.json && -d $W/codes_flite ]] \
      || { echo "no codec or codes here: run CALL=1 (or CALL=0) first, on the same warm machine"; exit 1; }
    shards
  fi
  LEFT=$(( $(left) - 20 ))
  if [[ $CALL == 4 ]]; then
    RES=(--init ${VOC_INIT:-tts/assets/default}); [[ -f $W/vocoder_flite/checkpoint.pt ]] && RES=(--resume)
    timeout $LEFT python3 training/train_vocoder.py --work $W --codec $W/codec_flite \
      --out $W/vocoder_flite --utterances ${VOC_UTT:-8000} --jobs 16 --batch 64 --lr ${VOC_LR:-8e-4} \
      --max-seconds $(( LEFT - 10 )) --log-every 500 --no-asr "${RES[@]}" > /tmp/logs/vocoder_call4.log 2>&1
    grep -v '"step"' /tmp/logs/vocoder_call4.log | tail -6
    tar czf $OUT/vocoder_flite.tgz -C $W --exclude checkpoint.pt vocoder_flite
  else
    RES=(); [[ $CALL == 3 ]] && RES=(--resume $W/v3_model)
    timeout $LEFT python3 training/train.py --data $W/codes_flite --codec $W/codec_flite --out /tmp/v3_model \
      --size fast --workers 12 --batch-tokens 65536 --lr 1.5e-3 --warmup 300 --max-seconds $(( LEFT - 10 )) \
      --schedule-seconds ${MODEL_SCHEDULE:-900} --history-rate 0.5 --history-frames 320 --dropout ${DROPOUT:-0} \
      --full-checkpoint $W/v3_full.pt "${RES[@]}" > /tmp/logs/model_call$CALL.log 2>&1
    grep -E "corpus|model:|resumed|trained|wrote|Error|\"step\": [0-9]*000," /tmp/logs/model_call$CALL.log | cut -c1-300
    rm -rf $W/v3_model && cp -r /tmp/v3_model $W/v3_model && cp /tmp/logs/model_call$CALL.log $W/v3_model/train.log
    tar czf /tmp/v3_model.tgz -C $W --transform "s,^v3_model,v3_model_call$CALL," v3_model \
      && split -b 15M /tmp/v3_model.tgz $OUT/v3_model_call$CALL.tgz.part-
  fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > /tmp/logs/gpu.txt
tar czf $OUT/logs$CALL.tgz -C /tmp logs && ls -la $OUT
