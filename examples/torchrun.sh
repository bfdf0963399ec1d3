#!/usr/bin/env bash
# Launch examples/train.py with torchrun: torchrun makes one process per rank, Lightning joins them.
#
#   bash examples/torchrun.sh                               # 8 CPU ranks here: (dp, pp, ep) = (2, 2, 2)
#   NPROC=4 bash examples/torchrun.sh --pp 2 --ep 2         # 4 ranks: dp fills to 1
#   NPROC=8 bash examples/torchrun.sh --accelerator gpu     # 8 GPUs on this node
#
# Several nodes: run the same line on every node with the node count, this node's rank and the first
# node's address (torchrun's static rendezvous; --devices and --num-nodes follow from them):
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC=8 bash examples/torchrun.sh --accelerator gpu --pp 4
#
# Arguments after the variables go to train.py (python examples/train.py --help).
set -euo pipefail

NPROC=${NPROC:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python}

exec "$PYTHON" -m torch.distributed.run \
    --nproc_per_node "$NPROC" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    "$(dirname "$0")/train.py" --devices "$NPROC" --num-nodes "$NNODES" "$@"
