#!/usr/bin/env bash
# End to end on one machine: start a gpuwire node on the CPU backend, train the example
# CNN through it, stop the node. Usage: bash examples/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
gpuwire serve --host 127.0.0.1 --port 0 --backend cpu >"$log" 2>&1 &
node_pid=$!
trap 'kill $node_pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 200); do
  grep -q "listening on" "$log" && break
  kill -0 $node_pid 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
head -n 1 "$log"
address=$(grep -o "listening on [^ ]*" "$log" | awk '{print $3}')
GPUWIRE_NODE="$address" python examples/train_mnist_like.py "$@"
