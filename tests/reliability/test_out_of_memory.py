"""Out of GPU memory: one line naming what filled the GPU and the settings that would fit the run,
exit 2, the last checkpoint intact and resumable (training/resilience/out_of_memory.py). The error is injected
with FLASHGPT_FAULT=oom:<step> (training/resilience/faults.py), the exception a full GPU raises, so this runs on
a CPU."""
import subprocess
import sys
from pathlib import Path

import torch

from training.config import load_config
from training.resilience.checkpoint import verify
from training.resilience.out_of_memory import explain, memory_options

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
import train_runner  # noqa: E402


def test_options_follow_the_config():
    one_gpu_27 = load_config("gpt_2.7b_8k.yaml", ["model.recompute_gelu_layers=14"])
    first = memory_options(one_gpu_27, world_size=1)
    assert first[0].startswith("model.recompute_gelu_layers=-1") and "first 14 of 32" in first[0]
    assert any(o.startswith("train.micro_batch_size=1 (now 2") for o in first)
    assert not any("recompute_gelu=true" in o or "norm_saves_output=true" in o for o in first)  # already on
    assert not any("fsdp" in o for o in first)  # one GPU: nothing to shard over

    plain_13 = memory_options(load_config("gpt_1.3b_8k.yaml"), world_size=8)
    assert [o.split(" ")[0] for o in plain_13] == ["model.recompute_gelu=true", "model.norm_saves_output=true",
                                                   "train.micro_batch_size=1", "engine.parallel=fsdp",
                                                   "model.recompute_blocks=true"]  # the dearest last
    assert "over the 8 GPUs" in plain_13[-2]

    nothing_left = load_config("gpt_2.7b_8k.yaml", ["train.micro_batch_size=1", "train.global_batch_size=8",
                                                    "model.recompute_blocks=true"])
    assert memory_options(nothing_left, world_size=1) == [
        "a shorter model.seq_len, a smaller model, or a GPU with more memory"]


def test_message_is_one_line_with_the_facts(tmp_path):
    cfg = load_config("gpt_2.7b_8k.yaml", ["model.recompute_gelu_layers=14"])
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.54 GiB. GPU 0 has a total capacity "
                                 "of 79.18 GiB of which 256.19 MiB is free. Including non-PyTorch memory, "
                                 "this process has 78.92 GiB memory in use.\nmore lines")
    msg = str(explain(err, cfg, step=7, world_size=1, device=torch.device("cpu"),
                      num_params=cfg.model.num_params(), last_checkpoint=tmp_path / "step_00000005"))
    assert "\n" not in msg
    assert msg.startswith("out of GPU memory after 7 completed steps (CUDA out of memory. Tried to allocate "
                          "1.54 GiB. GPU 0 has a total capacity of 79.18 GiB of which 256.19 MiB is free)")
    assert "Including non-PyTorch" not in msg  # torch's allocator breakdown is not repeated
    assert "39.7 GiB per GPU unsharded (2.67B parameters x 16 bytes)" in msg
    assert "2 x 8192 tokens" in msg
    assert "model.recompute_gelu_layers=-1" in msg
    assert f"the last checkpoint, {tmp_path / 'step_00000005'}, is intact" in msg
    built = str(explain(err, cfg, step=None, world_size=1, device=torch.device("cpu"), num_params=10,
                        last_checkpoint=None))
    assert "while building the model and optimizer" in built and "no checkpoint was written yet" in built
    assert "0.0 MiB per GPU unsharded (0.00M parameters x 16 bytes)" in built  # small sizes in MiB and M


def test_launcher_reports_it_and_the_checkpoint_resumes(tmp_path):
    """Step 4 runs out of memory after its first micro-batch: exit 2, one line, no traceback; the
    checkpoint of step 3 is intact and the same command with the fault gone continues from it."""
    out, cache = tmp_path / "runs", tmp_path / "cache"
    args = ["train.max_steps=5", "train.run_name=oom"]
    cmd = train_runner.train_cmd(out, cache, *args)
    proc = subprocess.run(cmd, cwd=REPO, env={**train_runner.env(), "FLASHGPT_FAULT": "oom:4"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("out of memory:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "out of GPU memory after 3 completed steps (CUDA out of memory. Tried to allocate 1.00 GiB" in lines[0]
    assert "train.micro_batch_size=2 (now 4" in lines[0]  # the runner's 2 micro-batches of 4 per step
    ckpts = sorted((out / "oom" / "checkpoints").glob("step_*"))
    assert [p.name for p in ckpts] == ["step_00000003"]  # nothing saved after the failure
    assert f"the last checkpoint, {ckpts[-1]}, is intact" in lines[0]
    assert verify(ckpts[-1]) is None
    resumed = train_runner.run(out, cache, *args, "train.resume=auto")
    assert f"resumed from {ckpts[-1]} at step 3" in resumed.stdout + resumed.stderr
    steps = train_runner.losses(out / "oom")
    assert max(steps) == 5 and 4 in steps


def test_one_rank_out_of_memory_ends_the_job(tmp_path):
    """Under torchrun, rank 1 runs out of memory in step 2 while rank 0 waits for it in the gradient
    all-reduce: rank 1 prints its line and leaves at once, and the job ends (no hang); the checkpoint
    of step 1 is intact."""
    out, cache = tmp_path / "runs", tmp_path / "cache"
    cmd = train_runner.train_cmd(out, cache, "train.max_steps=3", "train.ckpt_interval=1", "train.eval_interval=0",
                                 "train.run_name=oom2", nproc=2)
    proc = subprocess.run(cmd, cwd=REPO, env={**train_runner.env(), "FLASHGPT_FAULT": "oom:2:1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank 1] out of memory:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "after 1 completed steps" in lines[0] and "step_00000001, is intact" in lines[0]
    ckpt = out / "oom2" / "checkpoints" / "step_00000001"
    assert verify(ckpt) is None
    assert not (out / "oom2" / "checkpoints" / "step_00000002").exists()


def test_materialised_attention_is_told_to_recompute_first():
    """model.attention=math keeps every layer's s x s probabilities: recomputing the attention is the first
    setting named (16 heads x 8192^2 x 2 bytes = 2.00 GB per sequence and layer at 1.3B-8k); not once it is on."""
    math_13 = memory_options(load_config("gpt_1.3b_8k.yaml", ["model.attention=math"]), world_size=1)
    assert math_13[0].startswith("model.recompute_attention=true") and "2.00 GB in bf16" in math_13[0]
    on = load_config("gpt_1.3b_8k.yaml", ["model.attention=math", "model.recompute_attention=true"])
    assert not any("recompute_attention" in o for o in memory_options(on, world_size=1))
    assert not any("recompute_attention" in o for o in memory_options(load_config("gpt_1.3b_8k.yaml"), world_size=1))
