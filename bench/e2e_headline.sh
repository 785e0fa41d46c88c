#!/usr/bin/env bash
# The runs behind the headline end-to-end figures, on one GPU, one part per command (each fits in
# 10 minutes on an H100):
#
#   bash bench/e2e_headline.sh 1.3b OUT   # GPT-1.3B-8k: our trainer at 3 x 3 beside the plain setups
#   bash bench/e2e_headline.sh 2.7b OUT   # GPT-2.7B-8k: ours at 8 x 2 (18 blocks keep the GELU output)
#   bash bench/e2e_headline.sh log OUT    # a real launch/train.py run at 1.3B-8k: its log's MFU
#
# The plain setups are BENCHMARKS.md's (eager + SDPA cuDNN, torch.compile + SDPA flash) and the
# strongest plain step we know (torch.compile + SDPA cuDNN, with our compile settings), each at
# micro-batch 1 with the same sequences per optimizer step as ours. bench/e2e.py prints every setup's
# tokens/s, model TFLOP/s (paper formula 6N + 12Lds per token; causal-aware 6N + 6Lds), MFU vs 989,
# peak memory, clock / power / energy per token, our log's figure against CUDA events over the same
# steps, and ratios against eager + cuDNN and against the best plain setup of the run.
set -euo pipefail
part=${1:?"usage: e2e_headline.sh 1.3b|2.7b|log OUT"}
out=${2:?"usage: e2e_headline.sh 1.3b|2.7b|log OUT"}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"
case "$part" in
  1.3b)
    python3 bench/e2e.py --config gpt_1.3b_8k.yaml --steps 5 --warmup 2 --sustain-s 2 --accum 9 --no-profile \
      --setups ours_compile:train.micro_batch_size=3:train.global_batch_size=9,eager_cudnn,compile_flash,compile_cudnn \
      2>&1 | tee "$out/e2e_1.3b.log" ;;
  2.7b)
    ours=ours_compile:train.micro_batch_size=2:train.global_batch_size=16:model.recompute_gelu_layers=14
    python3 bench/e2e.py --config gpt_2.7b_8k.yaml --steps 4 --warmup 2 --sustain-s 2 --accum 16 --no-profile \
      --setups "$ours,eager_cudnn,compile_flash,compile_cudnn" 2>&1 | tee "$out/e2e_2.7b.log" ;;
  log)
    # the shipped 1.3B config at one GPU's batch (3 x 3), W&B offline: the figure users watch
    python3 launch/train.py --config gpt_1.3b_8k.yaml train.micro_batch_size=3 train.global_batch_size=9 \
      train.max_steps=12 train.eval_interval=0 train.ckpt_interval=0 train.save_final=false \
      logging.wandb=offline logging.progress=false train.out_dir="$out/runs" 2>&1 | tee "$out/train_1.3b.log"
    python3 - "$out/runs/gpt_1.3b_8k/metrics.jsonl" <<'EOF' | tee -a "$out/train_1.3b.log"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steady = [r for r in rows if r.get("tflops_paper") and r["step"] > 3]  # after compile and warm-up
print("real run, steps %d-%d: model TFLOP/s (paper) median %.1f, MFU %.1f%%, tokens/s %.0f, SM %.0f MHz"
      % (steady[0]["step"], steady[-1]["step"], statistics.median(r["tflops_paper"] for r in steady),
         100 * statistics.median(r["mfu_paper"] for r in steady),
         statistics.median(r["tokens_per_s"] for r in steady),
         statistics.median(r.get("gpu_sm_clock_mhz", 0) for r in steady)))
EOF
    ;;
  *) echo "unknown part $part: 1.3b, 2.7b or log" >&2; exit 2 ;;
esac
