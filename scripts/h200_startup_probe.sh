#!/usr/bin/env bash
# Where a one-shot `tts synthesize --device cuda` spends its start-up, on one H200. Run from the repo root
# through the device tool with carry [".whl-voice"] (the default voice's frontend wheels and soundfile).
# Writes, in this order: $OUT/trace.txt (scripts/trace_imports.py: the stack at the first import of
# torch._dynamo, sympy and triton), $OUT/cprofile.txt (the whole command under cProfile, by cumulative
# time) and $OUT/graphs_modes.txt (the whole command's wall time with each --graphs mode, startup, lazy
# and off, REPEATS times, default 2), each in a fresh process after one that fills the bytecode cache
# (PYTHONPYCACHEPREFIX: the image keeps none).
# Output is raw PCM (.pcm): a .wav goes through PyAV (tts/audio_formats.py), which the image lacks and
# whose wheel (with its FFmpeg) is too large to carry beside the tree.
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-voice/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
T="Please call Stella and ask her to bring these things."
python3 -m tts.cli.main synthesize "$T" --device cuda --seed 1 -o /tmp/w.pcm 2>&1 | tail -1   # (fills the bytecode cache)
python3 scripts/trace_imports.py --modules torch._dynamo,sympy,triton -- synthesize "$T" --device cuda --seed 1 -o /tmp/t.pcm > $OUT/trace.txt 2>&1
grep -A3 "^== \|tts/" $OUT/trace.txt | grep -v "site-packages/torch/_\|^--" | head -60
python3 -c "
import cProfile, pstats, sys, time
sys.argv = ['tts', 'synthesize', '$T', '--device', 'cuda', '--seed', '1', '-o', '/tmp/p.pcm']
from tts.cli.main import main
cProfile.run('main(sys.argv[1:])', '/tmp/prof')
s = pstats.Stats('/tmp/prof'); s.sort_stats('cumulative'); s.print_stats(45)
" > $OUT/cprofile.txt 2>&1
grep -E "cumtime|tts/|graphs/" $OUT/cprofile.txt | head -40
for g in $(for r in $(seq ${REPEATS:-2}); do echo startup lazy off; done); do
  t0=$(date +%s.%N); python3 -m tts.cli.main synthesize "$T" --device cuda --seed 1 --graphs $g -o /tmp/g.pcm 2>&1 | tail -1
  echo "graphs $g: whole command $(python3 -c "import time; print(round(time.time() - $t0, 2))") s" | tee -a $OUT/graphs_modes.txt
done
