#!/usr/bin/env bash
# The paper's setup: the default engine on NGPU GPUs of one node and on 1 GPU, same config
# and global batch; per-GPU tokens/s, model TFLOP/s, MFU, peak memory and the scaling efficiency
# (per-GPU tokens/s on NGPU over 1 GPU); the NGPU run is stopped half-way and resumed from its last
# checkpoint with the same command, so the loss curve shows the resume. Usage (GPU machine, repo root):
#   NGPU=8 STEPS=300 bash bench/scaling_run.sh [out_dir]
#   CONFIG=tiny_cpu.yaml NGPU=2 STEPS=6 STEPS1=4 bash bench/scaling_run.sh /tmp/sc   # CPU dry run
set -uo pipefail
NGPU=${NGPU:-8}; STEPS=${STEPS:-300}; STEPS1=${STEPS1:-20}; OUT=${1:-/tmp/scaling}
CONFIG=${CONFIG:-gpt_1.3b_8k.yaml}; EXTRA=${EXTRA:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
mkdir -p $OUT
COMMON="train.eval_interval=0 logging.progress=false logging.wandb=disabled train.out_dir=$OUT data.cache_dir=$OUT/cache $EXTRA"
run() {  # name nproc overrides...
  local name=$1 n=$2; shift 2
  torchrun --standalone --nproc_per_node=$n launch/train.py --config $CONFIG $COMMON train.run_name=$name "$@" \
    >> $OUT/$name.log 2>&1 || { echo "FAILED: $name (see $OUT/$name.log)"; tail -5 $OUT/$name.log; }
}
half=$(( STEPS / 2 ))
# NGPU: first half (a checkpoint at the stop), then the same command resumes from it to STEPS
run n${NGPU} $NGPU train.max_steps=$STEPS train.ckpt_interval=$half train.stop_after=$half
run n${NGPU} $NGPU train.max_steps=$STEPS train.ckpt_interval=$half
grep -h "resumed from\|resuming" $OUT/n${NGPU}.log | head -2
# 1 GPU, same global batch (NGPU x the accumulation), a short run for its throughput
run n1 1 train.max_steps=$STEPS1 train.ckpt_interval=0 train.save_final=false
python3 bench/summarize_runs.py --warmup 3 --baseline $OUT/n1 $OUT/n1 $OUT/n${NGPU}
