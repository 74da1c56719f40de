#!/usr/bin/env bash
# Train on several machines from one hostfile.
#
# Two ways, chosen by NODE_RANK:
#
# 1. NODE_RANK unset: run this once, on the first host. The deepspeed launcher starts every host
#    of the hostfile over passwordless ssh (pdsh); the repository and its environment must be at
#    the same path on every host.
#
#      MASTER_ADDR=10.0.0.1 launch/multi_node.sh launch/hostfile.example run.json ds_configs/zero3.json
#
# 2. NODE_RANK=k: no ssh. Run this on every host (a scheduler such as SLURM or Kubernetes
#    usually does), each with its own NODE_RANK (0 on the master host) and the same
#    MASTER_ADDR/MASTER_PORT; the hostfile still gives the slots of every host.
#
#      NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/multi_node.sh hostfile run.json   # on host 0
#      NODE_RANK=1 MASTER_ADDR=10.0.0.1 launch/multi_node.sh hostfile run.json   # on host 1
#
# Environment: MASTER_ADDR (required: an address every host reaches), MASTER_PORT (29500),
# NODE_RANK (see above), NCCL_* / GLOO_SOCKET_IFNAME as your network needs.
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTFILE=${1:?usage: launch/multi_node.sh HOSTFILE RUN_CONFIG [DS_CONFIG] [flags...]}
RUN_CONFIG=${2:?usage: launch/multi_node.sh HOSTFILE RUN_CONFIG [DS_CONFIG] [flags...]}
DS_CONFIG=${3:-ds_configs/zero2.json}
shift $(( $# >= 3 ? 3 : 2 ))
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the first host}"

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

NODE_ARGS=()
if [[ -n "${NODE_RANK:-}" ]]; then
  NODE_ARGS=(--no_ssh --node_rank "$NODE_RANK")
fi
exec deepspeed --hostfile "$HOSTFILE" "${NODE_ARGS[@]}" \
  --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" \
  --module ds_infcl.train --deepspeed_config "$DS_CONFIG" --config "$RUN_CONFIG" "$@"
