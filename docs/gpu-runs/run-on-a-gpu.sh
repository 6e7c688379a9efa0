#!/bin/bash
# From the repository root on a GPU machine, with gpuwire's missing dependencies as wheels in .whl/
# (docs/gpu-runs/README.md). Writes every figure under $OUT; the most wanted ones first, so a run cut
# short by its time limit still says something.
nvidia-smi -L; python3 -c "import torch; print(torch.__version__)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::RuntimeWarning
# the C++ helpers build here only with a compiler: say which paths the figures below used
timeout 120 python3 -c "from gpuwire.client import native as c; from gpuwire.node import native as n; from gpuwire.client import autocast as a; from gpuwire.node import loop as l; c.install(); n.install(); l.install(); print('helpers: client', c.status(), '| autocast', a.status(), '| node', n.status(), '| node loop', l.status())" | tee $OUT/helpers.txt
timeout 150 python3 -m bench --only gpu --out $OUT 2>&1 | tail -9 | tee $OUT/bench.log
# the client's flush age (GPUWIRE_FLUSH_AGE_US; default 25:200 since session 23) against the GPU's idle time;
# KEEP_TRACES=1: the raw traces too (with the host ops: GPUWIRE_PROFILE_KERNELS_CPU=1)
for age in ${FLUSH_AGES:-25:200 200}; do
  echo "flush age $age us"
  GPUWIRE_FLUSH_AGE_US=$age timeout 90 python3 -m bench.gpu_timeline --steps 3 --out $OUT/age-${age/:/-} ${KEEP_TRACES:+--keep-traces} 2>&1 | grep "^local\|^remote {"
done
[ -n "$AMP_TIMELINE" ] && timeout 90 python3 -m bench.gpu_timeline --amp --steps 3 --out $OUT/amp 2>&1 | grep "^local\|^remote {"
[ -z "$SKIP_CHECK" ] && timeout 120 python3 -m bench.gpu_check --out $OUT 2>&1 | grep -v "^  \|^Traceback\|^    " | cut -c1-700
[ -n "$WITH_PROFILE" ] && timeout 60 python3 -m bench.gpu_profile --out $OUT 2>&1 | tail -4
# the bench again: the GPU host's own noise between the two (the bf16 step is issue-bound)
[ -n "$BENCH_TWICE" ] && timeout 150 python3 -m bench --only gpu --out $OUT/again 2>&1 | tail -9 | tee $OUT/bench-again.log
# NODE_REPLAY=1: the node's host cost per frame on this GPU, on a recording of the tiny GPT-2 under bf16
# autocast (host-bound here): CPU per frame and the native loop's frames by op name (session 26)
if [ -n "$NODE_REPLAY" ]; then
  export GPUWIRE_REPLAY_BACKEND=cuda GPUWIRE_REPLAY_AMP=bf16
  timeout 120 python3 -m bench.node_replay record gpt2 60 /tmp/gpt2-bf16.bin 2>&1 | tail -1
  timeout 90 python3 -m bench.node_replay replay /tmp/gpt2-bf16.bin 3 2>&1 | tail -3 | tee $OUT/node-replay.txt
  timeout 90 python3 -m bench.node_replay ops /tmp/gpt2-bf16.bin 3 2>&1 | head -25 | tee -a $OUT/node-replay.txt
  unset GPUWIRE_REPLAY_BACKEND GPUWIRE_REPLAY_AMP
fi
rm -rf $OUT/node-profile
