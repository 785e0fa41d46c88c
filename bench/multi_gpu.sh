#!/usr/bin/env bash
# Engines on 1 and N GPUs of one host, the same global batch (8 sequences): tokens/s and model
# TFLOP/s per GPU, peak memory, and the loss curves (N-GPU vs 1-GPU), then (RESUME=1) a resume onto
# another GPU count per engine of RESUME_ENGINES (default "fsdp zero2 zero3", 125M model). Usage (on
# the GPU machine, repo root):
#   NGPU=2 STEPS=6 bash bench/multi_gpu.sh [out_dir]
#   CONFIG=gpt_2.7b_8k.yaml ENGINES="ddp zero2" GPUS="1 2" RESUME=0 bash bench/multi_gpu.sh /tmp/mg27
# ENGINES: ddp (engine.parallel=ddp, its grad_sync auto), ddp_hooks (engine.grad_sync=ddp: torch DDP),
# ddp_during (engine.grad_sync=during_backward), ddp_after (engine.grad_sync=after_backward),
# fsdp (FSDP2), zero0..zero3 (DeepSpeed). GPUS: the GPU counts to run each engine on.
# COMPILE: train.compile for every run (default false, see below). EXTRA: more config overrides for
# every run (e.g. EXTRA="model.attention=sdpa" for PyTorch's attention instead of our kernels).
# 1-GPU runs go two at a time (one per GPU) when NGPU >= 2: they share nothing but the host.
set -uo pipefail
NGPU=${NGPU:-2}; STEPS=${STEPS:-6}; OUT=${1:-/tmp/mg}
CONFIG=${CONFIG:-gpt_1.3b_8k.yaml}; RCONFIG=${RCONFIG:-gpt_125m_2k.yaml}  # the CPU dry run uses tiny_cpu.yaml
ENGINES=${ENGINES-ddp fsdp zero1 zero2 zero3}; GPUS=${GPUS:-1 $NGPU}; RESUME=${RESUME:-1}  # ENGINES="": resume runs only
RUN_TIMEOUT=${RUN_TIMEOUT:-240}
# torch.compile off by default here: the engine rows in bench/RESULTS.md were measured eager (and a
# compile adds a minute to every run); COMPILE=true measures the GPU configs' default instead.
COMPILE=${COMPILE:-false}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
COMMON="train.global_batch_size=8 train.micro_batch_size=1 train.max_steps=$STEPS train.eval_interval=0 train.ckpt_interval=0 \
train.save_final=false logging.progress=false logging.wandb=disabled train.out_dir=$OUT data.cache_dir=$OUT/cache \
train.compile=$COMPILE ${EXTRA:-}"
mkdir -p $OUT
python3 launch/prepare_data.py --config $CONFIG data.cache_dir=$OUT/cache >/dev/null 2>&1

engine_args() {  # engine name -> config overrides
  case $1 in
    ddp) echo "" ;;  # engine.grad_sync=auto: on one node with bf16, during_backward
    ddp_after) echo "engine.grad_sync=after_backward" ;;  # summed after the whole backward
    ddp_hooks) echo "engine.grad_sync=ddp" ;;  # torch DDP's overlapped reduction (no weight cache)
    ddp_during) echo "engine.grad_sync=during_backward" ;;  # each fp32 weight gradient reduced as written
    fsdp) echo "engine.parallel=fsdp" ;;
    zero[0-3]) echo "engine.type=deepspeed engine.zero_stage=${1#zero}" ;;
    *) echo "unknown engine $1 (ddp, ddp_hooks, ddp_during, ddp_after, fsdp, zero0..zero3)" >&2; return 1 ;;
  esac
}
go() {  # engine nproc [CUDA_VISIBLE_DEVICES]
  local e=$1 n=$2 devs=${3:-} name="${1}_${2}gpu" args
  args=$(engine_args $e) || return 1
  # pin to a GPU only when asked: an unset CUDA_VISIBLE_DEVICES must stay unset (an empty one hides
  # every GPU, and the trainer then runs on the CPU)
  local pin=(); [ -n "$devs" ] && pin=(env CUDA_VISIBLE_DEVICES=$devs)
  "${pin[@]}" timeout $RUN_TIMEOUT torchrun --standalone \
    --nproc_per_node=$n launch/train.py --config $CONFIG $COMMON train.run_name=$name $args \
    > $OUT/$name.log 2>&1 || echo "FAILED: $name (see $OUT/$name.log)"
  tail -2 $OUT/$name.log | grep -v "^$"
}
for n in $GPUS; do
  if [ "$n" = 1 ] && [ "$NGPU" -ge 2 ]; then
    set -- $ENGINES
    while [ $# -gt 0 ]; do  # two single-GPU runs at a time, on GPUs 0 and 1
      go $1 1 0 & if [ $# -gt 1 ]; then go $2 1 1 & shift; fi; shift; wait
    done
  else
    for e in $ENGINES; do go $e $n; done
  fi
done
if [ "$RESUME" = 1 ]; then
  # resume on another GPU count, per engine of RESUME_ENGINES (125M at 2k): an uninterrupted N-GPU
  # run, the same stopped at step 3, and its resume on 1 GPU (DeepSpeed converts to a universal
  # checkpoint first); compare resh_<engine>'s steps 4-6 with resh_<engine>_straight's.
  R="--config $RCONFIG train.global_batch_size=16 train.micro_batch_size=4 train.max_steps=6 \
train.eval_interval=0 train.ckpt_interval=3 logging.progress=false logging.wandb=disabled \
train.out_dir=$OUT data.cache_dir=$OUT/cache train.compile=false"
  for e in ${RESUME_ENGINES:-fsdp zero2 zero3}; do
    args=$(engine_args $e) || continue
    L=$OUT/resh_$e
    timeout 300 torchrun --standalone --nproc_per_node=$NGPU launch/train.py $R $args train.run_name=resh_${e}_straight > $L.1.log 2>&1 || echo "FAILED resh_${e}_straight"
    timeout 300 torchrun --standalone --nproc_per_node=$NGPU launch/train.py $R $args train.run_name=resh_$e train.stop_after=3 > $L.2.log 2>&1 || echo "FAILED resh_$e stop"
    timeout 300 torchrun --standalone --nproc_per_node=1 launch/train.py $R $args train.run_name=resh_$e > $L.3.log 2>&1 || echo "FAILED resh_$e resume"
    grep -h "resum" $L.3.log | head -2
  done
fi
python3 bench/summarize_runs.py --warmup $(( STEPS > 4 ? 3 : 2 )) $(ls -d $OUT/*/ | grep -v cache)
