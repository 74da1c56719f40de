#!/usr/bin/env bash
# Train on the GPUs (or CPU ranks) of one machine with the deepspeed launcher.
#
#   launch/single_node.sh RUN_CONFIG [DS_CONFIG] [extra trainer flags...]
#
# Environment (all optional):
#   NUM_GPUS      ranks to start (default: all visible GPUs; 2 on a machine without GPUs)
#   MASTER_PORT   rendezvous port (default 29500)
#   INCLUDE       deepspeed --include filter, e.g. "localhost:0,1" (overrides NUM_GPUS)
# Example:
#   NUM_GPUS=8 launch/single_node.sh my_run.json ds_configs/zero2.json --resume
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_CONFIG=${1:?usage: launch/single_node.sh RUN_CONFIG [DS_CONFIG] [flags...]}
DS_CONFIG=${2:-ds_configs/zero2.json}
shift $(( $# >= 2 ? 2 : 1 ))

if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  : "${NUM_GPUS:=$(python -c 'import torch; print(torch.cuda.device_count())')}"
else
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  : "${NUM_GPUS:=2}"
fi

if [[ -n "${INCLUDE:-}" ]]; then
  RANKS=(--include "$INCLUDE")
else
  RANKS=(--num_gpus "$NUM_GPUS")
fi
exec deepspeed "${RANKS[@]}" --master_port "${MASTER_PORT:-29500}" \
  --module ds_infcl.train --deepspeed_config "$DS_CONFIG" --config "$RUN_CONFIG" "$@"
