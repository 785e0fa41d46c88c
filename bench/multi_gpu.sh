#!/usr/bin/env bash
# Engines on 1 and N GPUs of one host at GPT-1.3B, seq 8192, the same global batch (8 sequences):
# tokens/s and model TFLOP/s per GPU, peak memory, and the loss curves (N-GPU vs 1-GPU), then a
# resume onto another GPU count (FSDP2, 125M model). Usage (on the GPU machine, repo root):
#   NGPU=2 STEPS=6 bash bench/multi_gpu.sh [out_dir]
set -uo pipefail
NGPU=${NGPU:-2}; STEPS=${STEPS:-6}; OUT=${1:-/tmp/mg}
CONFIG=${CONFIG:-gpt_1.3b_8k.yaml}; RCONFIG=${RCONFIG:-gpt_125m_2k.yaml}  # the CPU dry run uses tiny_cpu.yaml
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
COMMON="train.global_batch_size=8 train.max_steps=$STEPS train.eval_interval=0 train.ckpt_interval=0 \
train.save_final=false logging.progress=false logging.wandb=disabled train.out_dir=$OUT data.cache_dir=$OUT/cache"
python3 -m data.prepare --config $CONFIG data.cache_dir=$OUT/cache >/dev/null 2>&1
go() {  # name nproc overrides...
  local name=$1 n=$2; shift 2
  timeout 240 torchrun --standalone --nproc_per_node=$n launch/train.py --config $CONFIG \
    $COMMON train.run_name=$name "$@" > $OUT/$name.log 2>&1 || echo "FAILED: $name (see $OUT/$name.log)"
  tail -2 $OUT/$name.log | grep -v "^$"
}
mkdir -p $OUT
go ddp_1gpu 1
go ddp_${NGPU}gpu $NGPU
go fsdp_${NGPU}gpu $NGPU engine.parallel=fsdp
for z in 1 2 3; do go zero${z}_${NGPU}gpu $NGPU engine.type=deepspeed engine.zero_stage=$z; done
go zero2_1gpu 1 engine.type=deepspeed engine.zero_stage=2
# resume on another GPU count: FSDP2, 125M at 2k, saved on N GPUs at step 3, resumed on 1
R="--config $RCONFIG train.global_batch_size=16 train.micro_batch_size=4 train.max_steps=6 \
train.eval_interval=0 train.ckpt_interval=3 logging.progress=false logging.wandb=disabled \
train.out_dir=$OUT data.cache_dir=$OUT/cache engine.parallel=fsdp"
timeout 200 torchrun --standalone --nproc_per_node=$NGPU launch/train.py $R train.run_name=resh_straight > $OUT/resh1.log 2>&1 || echo FAILED resh_straight
timeout 200 torchrun --standalone --nproc_per_node=$NGPU launch/train.py $R train.run_name=resh train.stop_after=3 > $OUT/resh2.log 2>&1 || echo FAILED resh stop
timeout 200 torchrun --standalone --nproc_per_node=1 launch/train.py $R train.run_name=resh > $OUT/resh3.log 2>&1 || echo FAILED resh resume
grep -h "resum" $OUT/resh3.log | head -2
python3 bench/summarize_runs.py --warmup 3 $(ls -d $OUT/*/ | grep -v cache)
