#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::RuntimeWarning
timeout 85 python3 -m bench.gpu_check --out $OUT 2>&1 | grep -v "^  \|^Traceback\|^    " | cut -c1-700
timeout 110 python3 -m bench --only gpu --out $OUT 2>&1 | tail -9 | tee $OUT/bench.log
timeout 60 python3 -m bench.gpu_profile --out $OUT 2>&1 | tail -4
rm -rf $OUT/node-profile
