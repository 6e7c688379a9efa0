#!/bin/bash
# Session 25's A/B of GPUWIRE_FLUSH_EAGER (commands sent at once after each sync point) on a GPU:
# the device's timeline of GPT-2 small (fp32, then bf16 autocast) at each value, then the bench at
# the last. From the repository root, wheels in .whl/ as for run-on-a-gpu.sh.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::RuntimeWarning
timeout 120 python3 -c "from gpuwire.client import native as c; from gpuwire.node import native as n; from gpuwire.node import loop as l; c.install(); n.install(); l.install(); print('helpers', c.status(), n.status(), l.status())"
for eager in ${EAGERS:-0 32}; do
  echo "eager $eager"
  GPUWIRE_FLUSH_EAGER=$eager timeout 75 python3 -m bench.gpu_timeline --steps 3 --out $OUT/eager-$eager 2>&1 | grep "^local\|^remote {"
done
for eager in ${AMP_EAGERS:-32}; do
  echo "bf16 eager $eager"
  GPUWIRE_FLUSH_EAGER=$eager timeout 75 python3 -m bench.gpu_timeline --amp --steps 3 --out $OUT/eager-$eager 2>&1 | grep "^local\|^remote {"
done
GPUWIRE_FLUSH_EAGER=${BENCH_EAGER:-32} timeout 100 python3 -m bench --only gpu --out $OUT 2>&1 | tail -9
