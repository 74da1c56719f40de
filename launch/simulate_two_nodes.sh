#!/usr/bin/env bash
# Simulate two nodes on one machine (CPU or GPU): two launchers, one hostfile, --no_ssh, 127.0.0.1.
# What the CPU test suite runs (tests/train/test_engine_multirank.py); useful to try a multi-node
# configuration before booking machines.
#
#   launch/simulate_two_nodes.sh RUN_CONFIG [DS_CONFIG] [flags...]
#
# Environment: SLOTS (ranks per simulated node, default 1), MASTER_PORT (default 29531).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_CONFIG=${1:?usage: launch/simulate_two_nodes.sh RUN_CONFIG [DS_CONFIG] [flags...]}
DS_CONFIG=${2:-ds_configs/zero2.json}
shift $(( $# >= 2 ? 2 : 1 ))
SLOTS=${SLOTS:-1}
PORT=${MASTER_PORT:-29531}
HOSTFILE=$(mktemp)
trap 'rm -f "$HOSTFILE"' EXIT
printf 'node0 slots=%s\nnode1 slots=%s\n' "$SLOTS" "$SLOTS" > "$HOSTFILE"
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
run() {
  deepspeed --hostfile "$HOSTFILE" --no_ssh --node_rank "$1" --master_addr 127.0.0.1 --master_port "$PORT" \
    --module ds_infcl.train --deepspeed_config "$DS_CONFIG" --config "$RUN_CONFIG" "${@:2}"
}
run 1 "$@" > /dev/null 2>&1 &
NODE1=$!
run 0 "$@"
wait "$NODE1"
