#!/usr/bin/env bash
# End to end on one machine: a pool, a gpuwire node on the CPU backend registered with it,
# a tenant with a key, and the example CNN trained through a leased slice of the node's GPU.
# Everything runs on loopback and is stopped at the end. Usage: bash examples/quickstart.sh [--epochs N]
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

wait_for() {  # wait_for FILE PATTERN PID
  for _ in $(seq 1 300); do
    grep -q "$2" "$1" && return 0
    kill -0 "$3" 2>/dev/null || { cat "$1"; exit 1; }
    sleep 0.1
  done
  echo "timed out waiting for: $2" >&2; cat "$1"; exit 1
}

export GPUWIRE_ADMIN_KEY="gpw_admin_$(python -c 'import secrets; print(secrets.token_hex(16))')"
gpuwire pool --host 127.0.0.1 --port 0 --db "$work/pool.db" --log-level warning >"$work/pool.log" 2>&1 &
pids+=($!)
wait_for "$work/pool.log" "listening on" $!
export GPUWIRE_POOL=$(grep -o "http://[^ ]*" "$work/pool.log" | head -n 1)
echo "pool:   $GPUWIRE_POOL"

node_key=$(GPUWIRE_API_KEY=$GPUWIRE_ADMIN_KEY gpuwire key create --role node)
GPUWIRE_API_KEY=$node_key gpuwire serve --host 127.0.0.1 --port 0 --backend cpu --pool "$GPUWIRE_POOL" \
  --node-id node-1 --log-level warning >"$work/node.log" 2>&1 &
pids+=($!)
wait_for "$work/node.log" "listening on" $!
echo "node:   $(head -n 1 "$work/node.log")"

GPUWIRE_API_KEY=$GPUWIRE_ADMIN_KEY gpuwire tenant create demo --max-gpus 1 --max-memory 8GiB >/dev/null
export GPUWIRE_API_KEY=$(GPUWIRE_API_KEY=$GPUWIRE_ADMIN_KEY gpuwire key create --tenant demo)
for _ in $(seq 1 100); do  # the node's registration reaches the pool within a heartbeat
  GPUWIRE_API_KEY=$GPUWIRE_ADMIN_KEY gpuwire ls nodes --json 2>/dev/null | grep -q node-1 && break
  sleep 0.1
done

# a quarter of the GPU and 2 GiB of its memory, for this training run
gpuwire run --pool "$GPUWIRE_POOL" --share 0.25 --memory 2GiB -- python examples/train_mnist_like.py "$@"
