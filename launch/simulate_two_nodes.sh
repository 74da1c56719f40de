#!/usr/bin/env bash
# Simulate two nodes on one machine (CPU or GPU): two launchers, one hostfile, --no_ssh, 127.0.0.1.
# What the CPU test suite runs (tests/train/test_engine_multirank.py); useful to try a multi-node
# configuration before booking machines.
#
#   launch/simulate_two_nodes.sh RUN_CONFIG [DS_CONFIG] [flags...]
#
# Environment: SLOTS (ranks per simulated node, default 1), MASTER_PORT (default 29531).
#
# On a GPU machine each simulated node gets its own GPUs (node0: 0..SLOTS-1, node1: SLOTS..2*SLOTS-1,
# through the launcher's --include) and NCCL talks between the nodes as between hosts: sockets over
# the loopback interface (NCCL_SOCKET_IFNAME=lo), with the same-host shortcuts (P2P, shared memory)
# off. Set NCCL_P2P_DISABLE=0 NCCL_SHM_DISABLE=0 to allow them.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_CONFIG=${1:?usage: launch/simulate_two_nodes.sh RUN_CONFIG [DS_CONFIG] [flags...]}
DS_CONFIG=${2:-ds_configs/zero2.json}
shift $(( $# >= 2 ? 2 : 1 ))
SLOTS=${SLOTS:-1}
PORT=${MASTER_PORT:-29531}
INCLUDE=()
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
  if (( GPUS < 2 * SLOTS )); then
    echo "simulate_two_nodes.sh: 2 nodes x SLOTS=$SLOTS ranks need $((2 * SLOTS)) GPUs, this machine has $GPUS" >&2
    exit 2
  fi
  node0=$(seq -s, 0 $((SLOTS - 1))); node1=$(seq -s, "$SLOTS" $((2 * SLOTS - 1)))
  INCLUDE=(--include "node0:${node0}@node1:${node1}")
  HOST_SLOTS=$GPUS  # --include picks GPU indices among a host's slots
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_P2P_DISABLE=${NCCL_P2P_DISABLE:-1} NCCL_SHM_DISABLE=${NCCL_SHM_DISABLE:-1}
else
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
HOSTFILE=$(mktemp)
trap 'rm -f "$HOSTFILE"' EXIT
printf 'node0 slots=%s\nnode1 slots=%s\n' "${HOST_SLOTS:-$SLOTS}" "${HOST_SLOTS:-$SLOTS}" > "$HOSTFILE"
run() {
  deepspeed --hostfile "$HOSTFILE" "${INCLUDE[@]}" --no_ssh --node_rank "$1" --master_addr 127.0.0.1 --master_port "$PORT" \
    --module ds_infcl.train --deepspeed_config "$DS_CONFIG" --config "$RUN_CONFIG" "${@:2}"
}
run 1 "$@" > /dev/null 2>&1 &
NODE1=$!
run 0 "$@"
wait "$NODE1"
