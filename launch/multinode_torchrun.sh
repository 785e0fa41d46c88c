#!/usr/bin/env bash
# Multi-node training with torchrun's c10d rendezvous. Run this same script on every node:
#   HEAD_NODE=node01 NNODES=2 bash launch/multinode_torchrun.sh --config gpt_1.3b_8k.yaml train.out_dir=/shared/runs
# HEAD_NODE: a host name or address every node can reach (port RDZV_PORT open between nodes).
# train.out_dir must be on a file system all nodes share: rank 0 writes checkpoints, all ranks read.
set -euo pipefail
: "${HEAD_NODE:?set HEAD_NODE to the rendezvous host}"
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_PORT=${RDZV_PORT:-29500}
RUN_ID=${RUN_ID:-flashgpt}

# NCCL: keep NVLink SHARP multicast off where the cluster asks (it can wedge shared GPUs); pick the
# network interface for bootstrap traffic; turn on NCCL_DEBUG=INFO when a job hangs at start.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
# export NCCL_SOCKET_IFNAME=eth0        # the interface that reaches the other nodes
# export NCCL_IB_HCA=mlx5               # InfiniBand adapters, if any
# export NCCL_DEBUG=INFO
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec torchrun --nnodes="$NNODES" --nproc_per_node="$GPUS_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$HEAD_NODE:$RDZV_PORT" --rdzv_id="$RUN_ID" \
    launch/train.py "$@"
