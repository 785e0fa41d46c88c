#!/usr/bin/env bash
# GPT-1.3B at long context on one node (engine.context_parallel_size, docs/engines.md): 32k and 64k with the
# context split over 4 GPUs, and as 2 context x 2 data-parallel GPUs, longer windows (with recomputation,
# FSDP2, then whole blocks recomputed, where memory needs them) until one does not fit, and 8k on one GPU as
# the per-token baseline. Per run: tokens/s, model TFLOP/s per GPU and MFU (paper and causal-aware), peak
# memory, and the last step profiled: its GPU kernel time by class, the all-to-alls under "communication"
# (training/telemetry/profiling.py); then the per-token cost against 8k beside what the FLOP formula
# predicts. Usage (the GPU machine, repo root, 4 GPUs):
#   bash bench/long_context.sh [out_dir]
#   LONGEST="131072 262144 524288" STEPS=6 bash bench/long_context.sh /tmp/lc   # the windows tried after 64k
#   ONLY="c4_128k c4_128k_recompute c4_128k_fsdp c4_128k_blocks" ...   # one window's ladder (see below)
#   ONLY="n1_8k" bash bench/long_context.sh /tmp/lc      # just these runs (names as printed)
# STEPS optimizer steps per run (the last one under the profiler, left out of the medians), GB sequences
# per optimizer step, RUN_TIMEOUT seconds per run, EXTRA more overrides for every run, BASELINE_GPU the GPU
# of the one-GPU 8k run (0). A run whose folder in out_dir holds its summary.json already is kept, not run
# again: a sweep cut short goes on where it stopped when called again with the same out_dir.
set -uo pipefail
STEPS=${STEPS:-8}; GB=${GB:-8}; OUT=${1:-/tmp/long_context}; LONGEST=${LONGEST-131072 262144 524288}
RUN_TIMEOUT=${RUN_TIMEOUT:-420}; EXTRA=${EXTRA:-}; ONLY=${ONLY:-}; BASELINE_GPU=${BASELINE_GPU:-0}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
COMMON="train.max_steps=$STEPS train.profile_step=$STEPS train.global_batch_size=$GB train.eval_interval=0 \
train.ckpt_interval=0 train.save_final=false logging.progress=false logging.wandb=disabled train.out_dir=$OUT \
train.resume=none train.overwrite=true \
data.cache_dir=$OUT/cache $EXTRA"
mkdir -p $OUT
python3 launch/prepare_data.py --config gpt_1.3b_64k.yaml data.cache_dir=$OUT/cache >/dev/null 2>&1
DONE=()
run() {  # name nproc config overrides...
  local name=$1 n=$2 cfg=$3; shift 3
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return 2; fi  # 2: not selected
  if [ -f $OUT/$name/summary.json ]; then DONE+=($OUT/$name); echo "$name: ok (earlier call)"; return 0; fi
  if timeout $RUN_TIMEOUT torchrun --standalone --nproc_per_node=$n launch/train.py --config $cfg $COMMON \
      train.run_name=$name "$@" > $OUT/$name.log 2>&1; then
    DONE+=($OUT/$name); echo "$name: ok"
  elif grep -q "out of GPU memory" $OUT/$name.log; then
    echo "$name: out of GPU memory ($(grep -m1 -o 'out of GPU memory[^;]*' $OUT/$name.log))"; return 3
  else
    echo "$name: FAILED (see $OUT/$name.log)"; tail -5 $OUT/$name.log; return 1
  fi
}
CUDA_VISIBLE_DEVICES=$BASELINE_GPU run n1_8k 1 gpt_1.3b_8k.yaml
run c4_32k 4 gpt_1.3b_32k.yaml
run c2d2_32k 4 gpt_1.3b_32k.yaml engine.context_parallel_size=2
run c4_64k 4 gpt_1.3b_64k.yaml
run c2d2_64k 4 gpt_1.3b_64k.yaml engine.context_parallel_size=2  # a third less all-to-all per token than C=4
# Longer windows on the 64k config, each up a ladder until a rung fits: as configured; the MLP's GELU and
# the attention recomputed in the backward; and those with FSDP2 (weights, gradients and AdamW moments
# sharded over the 4 GPUs: ~16 GB less each for 1.3B); every block recomputed (model.recompute_blocks: ~1 of
# ~17 activation units per token and layer) with FSDP2. A longer window starts at the rung the last needed;
# the sweep ends at the first window no rung fits. These windows read the shipped corpus 8 times over
# (data/corpus holds ~160k training tokens, fewer than one 256k window; repeats change no step's cost).
LONG_DATA=$OUT/corpus_x8
if [ ! -d $LONG_DATA ]; then
  mkdir -p $LONG_DATA.tmp
  for f in data/corpus/*.jsonl; do for _ in 1 2 3 4 5 6 7 8; do cat "$f"; done > $LONG_DATA.tmp/$(basename "$f"); done
  mv $LONG_DATA.tmp $LONG_DATA
fi
RUNGS=("" "_recompute" "_fsdp" "_blocks")
RUNG_ARGS=("" "model.recompute_gelu=true model.recompute_attention=true"
           "model.recompute_gelu=true model.recompute_attention=true engine.parallel=fsdp"
           "model.recompute_blocks=true engine.parallel=fsdp")
first=0
for seq in $LONGEST; do  # longer windows
  rc=3
  for ((i = first; i < ${#RUNGS[@]}; i++)); do
    # shellcheck disable=SC2086  # RUNG_ARGS holds several overrides
    run c4_$(( seq / 1024 ))k${RUNGS[$i]} 4 gpt_1.3b_64k.yaml model.seq_len=$seq "data.source=[$LONG_DATA]" \
      ${RUNG_ARGS[$i]}; rc=$?
    [ $rc -eq 0 ] || [ $rc -eq 1 ] && break  # trained, or failed otherwise than by memory: no next rung
    [ $rc -eq 3 ] && first=$(( i + 1 ))  # out of memory: longer windows start higher
  done
  [ $rc -eq 1 ] || [ $rc -eq 3 ] && break
done
BASE=()  # the one-GPU baseline, in the tables when it was measured (by this call or an earlier one)
if [ -f $OUT/n1_8k/summary.json ]; then
  BASE=(--baseline $OUT/n1_8k)
  [[ " ${DONE[*]-} " == *" $OUT/n1_8k "* ]] || DONE=($OUT/n1_8k "${DONE[@]}")
fi
[ ${#DONE[@]} -gt 0 ] || { echo "no run measured"; exit 1; }
python3 bench/summarize_runs.py --warmup 3 "${BASE[@]}" "${DONE[@]}"
python3 - "${DONE[@]}" <<'PY'
# Model FLOPs per token of each run (GPTConfig.flops_per_token, causal-aware) over 8k's: the per-token
# cost the formula predicts, to set beside the measured "per GPU vs n1_8k" column (its inverse).
import sys
from pathlib import Path
from omegaconf import OmegaConf
from model.config import GPTConfig
def fpt(run):
    m = OmegaConf.to_container(OmegaConf.load(Path(run) / "config.yaml"))["model"]
    return GPTConfig(**m).flops_per_token(causal_aware=True)
base = next((r for r in sys.argv[1:] if r.endswith("n1_8k")), None)
if base:
    print("\n| run | causal-aware FLOPs per token vs n1_8k (predicted per-token cost) |\n|---|---|")
    for r in sys.argv[1:]:
        print(f"| {Path(r).name} | {fpt(r) / fpt(base):.2f}x |")
PY
