"""End-to-end training throughput on one GPU: our trainer's real step beside plain-PyTorch steps,
same shapes, same accumulation, one process.

    python bench/e2e.py --config gpt_1.3b_8k.yaml --steps 12 --accum 8
    python bench/e2e.py --config gpt_2.7b_8k.yaml --setups ours,eager_cudnn

Setups:
  ours           launch/train.py's Trainer.fit, eager (train.compile=false) (data loader, accumulation,
                 clipping, fused AdamW, logging, metrics) with the config's attention (auto: our
                 kernels on CUDA); its figure is read back from the run's metrics.jsonl, i.e. the
                 number users see in W&B
                 and the config's MLP (auto: GELU in cuBLASLt's GEMM epilogues on CUDA, model/mlp.py)
  ours_flash     the same with model.attention=flash (our kernels, forced)
  ours_sdpa      the same with model.attention=sdpa (PyTorch SDPA: cuDNN on H100)
  ours_compile, ours_flash_compile, ours_sdpa_compile
                 the same with train.compile=true (torch.compile of the model, our op traced inside)
  eager_cudnn    plain PyTorch: the same GPT (the config's model section, model.residual included)
                 with SDPA forced to cuDNN, nn.Linear + F.gelu, eager, plain cross-entropy
  eager_flash    the same with SDPA's FlashAttention-2 backend
  compile_flash  torch.compile(model) with SDPA flash
  compile_cudnn  torch.compile(model) with SDPA cuDNN
A setup may carry trainer overrides after colons, for an A/B in one run:
  ours_compile:engine.weight_cache=disabled   ours_compile:model.mlp=torch
or for our trainer at another micro-batch than the plain setups (tokens per step and tokens/s are each
setup's own): ours_compile:train.micro_batch_size=3:train.global_batch_size=9
An override env.NAME=VALUE sets an environment variable for that setup only, for a setting read while
the setup builds or runs its trainer (ours:env.FLASHGPT_PEAK_TFLOPS=756: the MFU its log reports against
an H100 PCIe's peak) or when the step is traced (dynamo is reset around such a setup).
--rounds R runs the list R times, reversed every other round (A B, B A, ...): each setup's figure is the
median of its rounds, and each round's ratios are printed, so the board's warming over the run is shared out.
--micro-batch B runs every setup with B sequences per forward and accum / B micro-batches per
optimizer step (the same tokens per step).
Plain steps feed random tokens already on the GPU and time with CUDA events (median of steps after
warm-up). Our trainer's figure is its own log's (host clocks at logging points, as users see it); the
same steps are also timed with CUDA events recorded as each step ends, and the table's "log vs CUDA
events" column is the log's throughput relative to theirs (they should agree within 2%). "ratio vs best plain"
divides by the fastest plain setup of the run. One more step of each setup (unless --no-profile) runs under torch.profiler for the
attention share of GPU kernel time (training/telemetry/profiling.py), outside the timed steps, and its summed
kernel time over the median step time is the "GPU busy" column: 100% minus it bounds what removing launch gaps (CUDA
graphs) could give. Model TFLOP/s per the paper: (6·N + 12·L·d·s) FLOPs per token; causal-aware: 6·N + 6·L·d·s.
Every compiled setup, ours and plain, compiles with training/compile/inductor_barrier.py's fix installed (a
race in inductor's LayerNorm kernels makes compiled steps wrong without it), so all measure correct
programs, and with the config's train.compile_options (TorchInductor settings) and
train.compile_persistent_rows (training/compile/persistent_rows.py), plain ones too.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.allocator import expandable_segments_by_default  # noqa: E402

expandable_segments_by_default()  # every setup, ours and plain, with the launcher's allocator setting

from model.gpt import GPT  # noqa: E402
from training.compile.inductor_barrier import install as install_inductor_barrier  # noqa: E402
from training.compile.options import prepare_compile  # noqa: E402
from training.config import load_config  # noqa: E402
from training.telemetry.gpu import GpuTelemetry  # noqa: E402
from training.telemetry.metrics import measure_gemm_ceiling, peak_flops  # noqa: E402
from training.telemetry.profiling import profile_call  # noqa: E402

SDPA = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION"}


def plain_step_times(cfg, setup: str, steps: int, warmup: int, accum: int, micro: int, trace_dir: Path,
                     profile: bool = True) -> dict:
    """Median seconds per optimizer step of a plain-PyTorch loop; peak memory in GB."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mode, backend = setup.split("_")
    mcfg = cfg.model
    mcfg.attention, mcfg.fused_loss, mcfg.mlp = "sdpa", False, "torch"  # plain: SDPA, nn.Linear + F.gelu
    torch.manual_seed(0)
    model = GPT(mcfg, device=torch.device("cuda")).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    # the config's compile settings (train.compile_options, train.compile_persistent_rows), as our trainer's
    options = (prepare_compile(cfg.train) or None) if mode == "compile" else None
    # Each plain compiled setup compiles its own program: neither dynamo's code cache nor TorchInductor's
    # caches key on SDPA's backend choice, so compile_cudnn after compile_flash in one process ran
    # compile_flash's kernels (the same TFLOP/s and attention share to the digit). Dynamo forgets
    # earlier setups here; the caches stay off while this setup compiles and runs.
    if mode == "compile":
        torch._dynamo.reset()
    own_compile = (torch._inductor.config.patch(force_disable_caches=True) if mode == "compile"
                   else contextlib.nullcontext())
    fwd = torch.compile(model, options=options) if mode == "compile" else model
    T = mcfg.seq_len
    data = torch.randint(0, mcfg.vocab_size, (accum, micro, T + 1), device="cuda")  # (accum, B, T+1)
    times = []

    def one_step():
        for m in range(accum):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(data[m, :, :-1], data[m, :, 1:])
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    telemetry = GpuTelemetry.open(torch.device("cuda"))
    power = {}
    with own_compile, sdpa_kernel(getattr(SDPBackend, SDPA[backend])):
        for i in range(warmup + steps):
            if i == warmup:
                torch.cuda.synchronize()
                if telemetry is not None:
                    telemetry.mark()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            one_step()
            end.record()
            end.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end) / 1e3)
    if telemetry is not None:
        power = telemetry.mark(tokens=steps * accum * micro * T)
        telemetry.close()
    out = {"step_s": statistics.median(times), "tokens": accum * micro * T,
           "mem_gb": torch.cuda.max_memory_allocated() / 1e9, **power}
    out["attn_share"] = out["mm_share"] = out["kernel_s"] = None
    if profile:
        with own_compile, sdpa_kernel(getattr(SDPBackend, SDPA[backend])):
            _, shares = profile_call(one_step, torch.device("cuda"), trace_dir / f"{setup}.json")
        out["attn_share"], out["mm_share"] = shares["time_share_attention"], shares["time_share_matmul"]
        out["kernel_s"] = shares["kernel_time_s"]
    return out  # model, optimizer and data are freed with this frame


def ours_step_times(config: str, overrides: list, steps: int, warmup: int, accum: int, micro: int,
                    run_name: str, trace_dir: Path, profile: bool = True) -> dict:
    """Run the real trainer; read its own per-step metrics (what the W&B/JSON-lines log shows)."""
    from training.distributed import init_distributed
    from training.trainer import Trainer

    out_dir = str(trace_dir)
    cfg = load_config(config, [f"train.global_batch_size={accum * micro}", f"train.micro_batch_size={micro}",
                               f"train.max_steps={warmup + steps + 1}", "train.eval_interval=0",
                               # one extra step: profiled, and the last timed step's record is written
                               # at its sync (below)
                               f"train.profile_step={warmup + steps + 1 if profile else 0}",
                               "train.ckpt_interval=0", "train.save_final=false", "logging.wandb=disabled",
                               "logging.progress=false", f"train.out_dir={out_dir}",
                               f"train.run_name={run_name}", "train.resume=none", *overrides])
    dist = init_distributed(cfg.train.device, cfg.engine.backend)
    torch.cuda.reset_peak_memory_stats()  # the previous setup's peak must not show in this one
    trainer = Trainer.build(cfg, dist)
    ends = step_end_events(trainer)  # an independent clock beside the log's
    try:
        trainer.fit()
    finally:
        del trainer.train_step  # the wrapper holds the trainer: a cycle that would keep its memory
    records = [json.loads(line) for line in (Path(out_dir) / run_name / "metrics.jsonl").read_text().splitlines()]
    last = warmup + steps + 1
    times = [r["step_time_s"] for r in records if r.get("step_time_s") and warmup < r["step"] < last]
    tokens = cfg.train.global_batch_size * cfg.model.seq_len  # per optimizer step (one process)
    shares = next((r for r in records if r["step"] == last and "time_share_attention" in r), {})
    backend = f"{trainer.engine.model.attention_backend}, mlp {getattr(trainer.engine.model, 'mlp_impl', 'torch')}"
    del trainer
    torch.cuda.empty_cache()
    mem = max(r.get("mem_max_alloc_gb") or 0.0 for r in records)  # the trainer resets the peak per log
    timed = [r for r in records if warmup < r["step"] < last]
    power = {k: statistics.median(r[k] for r in timed if k in r)
             for k in ("gpu_sm_clock_mhz", "gpu_power_w", "gpu_j_per_token", "gpu_power_capped", "gpu_hw_slowdown",
                       "gpu_thermal_capped", "gpu_temp_c", "gpu_mem_temp_c")
             if any(k in r for r in timed)}
    # A step's record is written once its values have reached the host, which is at the next step's
    # per-step sync (training/telemetry/metrics.py DeferredScalars): record k's time ~ the end of step k + 1.
    step_s = statistics.median(times)
    # the same steps timed on the GPU: CUDA events at the end of each step (host clocks read nothing)
    event_times = [ends[k - 1].elapsed_time(ends[k]) / 1e3 for k in range(warmup + 1, last)
                   if k - 1 in ends and k in ends]
    event_s = statistics.median(event_times) if event_times else None
    return {"step_s": step_s, "event_step_s": event_s, "tokens": tokens, "mem_gb": mem, "attention": backend,
            "attn_share": shares.get("time_share_attention"), "mm_share": shares.get("time_share_matmul"),
            "kernel_s": shares.get("kernel_time_s"), **power}


def step_end_events(trainer) -> dict:
    """Record a CUDA event as each of `trainer`'s optimizer steps ends (its last kernel queued), keyed
    by the step number it completes (1 = the first). The log's step time comes from host clocks at
    logging points (training/telemetry/metrics.py); the events time the same steps on the device, so the two
    figures check each other. Recording an event does not synchronise."""
    ends = {}
    step_once = trainer.train_step

    def timed_step(*args, **kwargs):
        out = step_once(*args, **kwargs)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        ends[trainer.step + 1] = event  # fit() increments trainer.step after the call
        return out

    trainer.train_step = timed_step  # fit() (and its profiled step) look the method up per call
    return ends


def parse_setup(setup: str) -> tuple:
    """name:override:env.NAME=VALUE:... -> (name, its config overrides, its environment variables)."""
    name, *parts = setup.split(":")
    env = dict(o[len("env."):].split("=", 1) for o in parts if o.startswith("env."))
    return name, [o for o in parts if not o.startswith("env.")], env


def run_setup(args, setup: str, n_micro: int, micro: int, run_name: str, trace_dir: Path, profile: bool) -> dict:
    """One setup's timed steps (and profiled step): our trainer's or a plain-PyTorch loop's."""
    name, setup_overrides, env = parse_setup(setup)
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if env:  # dynamo does not guard on the environment: trace this setup afresh
        torch._dynamo.reset()
    row_cfg = load_config(args.config, [*args.overrides, *setup_overrides])  # this row's model shapes
    if setup.startswith("ours"):
        parts = set(name.split("_")[1:])
        if not parts <= {"flash", "sdpa", "compile"} or {"flash", "sdpa"} <= parts:
            raise SystemExit(f"unknown setup {setup!r}: ours[_flash|_sdpa][_compile]")
        extra = [f"model.attention={a}" for a in ("flash", "sdpa") if a in parts] + \
                [f"train.compile={'true' if 'compile' in parts else 'false'}"]
        r = ours_step_times(args.config, [*args.overrides, *extra, *setup_overrides], args.steps,
                            args.warmup, n_micro, micro, run_name, trace_dir, profile)
    else:
        if setup_overrides:
            raise SystemExit(f"{setup!r}: overrides apply to our trainer's setups only")
        r = plain_step_times(row_cfg, name, args.steps, args.warmup, n_micro, micro, trace_dir, profile)
        r["attention"] = f"sdpa {name.split('_')[1]}"
    for k, v in saved_env.items():  # this setup's environment variables end with it
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if env:
        torch._dynamo.reset()
    torch.cuda.empty_cache()
    if not args.keep_traces:
        for trace in [*trace_dir.glob("*.json"), *trace_dir.glob("*/profile_step_*.json")]:
            trace.unlink()
    return r


def setup_order(setups: list, rounds: int) -> list:
    """(round, setup) pairs in run order: the setups as given in even rounds, reversed in odd ones, so
    the board's drift over the run (it warms, and at the power limit its clock follows) falls on every
    setup alike."""
    return [(rnd, s) for rnd in range(rounds) for s in (setups if rnd % 2 == 0 else setups[::-1])]


def combine_rounds(results: list) -> dict:
    """One setup's rounds as one result: the median of the rounds' step times (each already a median
    over its steps) and of their telemetry; the profile and the attention label of the first round;
    the peak memory of all."""
    out = dict(results[0])
    for key in results[0]:
        values = [r[key] for r in results if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if key in ("attn_share", "mm_share", "kernel_s", "tokens") or len(values) != len(results):
            continue
        out[key] = max(values) if key == "mem_gb" else statistics.median(values)
    return out


def print_round_ratios(setups: list, results: dict) -> None:
    """Per round: each of our setups over the fastest plain setup of that round."""
    plain = [s for s in setups if not s.startswith("ours")]
    for rnd in range(len(results[setups[0]])):
        tok_s = {s: results[s][rnd]["tokens"] / results[s][rnd]["step_s"] for s in setups}
        best = max(plain, key=tok_s.get) if plain else None
        ratios = ", ".join(f"{s} {tok_s[s] / tok_s[best]:.3f}" for s in setups if s.startswith("ours")) if best else "-"
        print(f"[e2e] round {rnd + 1}: vs {best}: {ratios}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="gpt_1.3b_8k.yaml")
    p.add_argument("--setups", default="ours,ours_compile,eager_cudnn,compile_cudnn")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--accum", type=int, default=8, help="sequences per optimizer step (micro-batches of 1)")
    p.add_argument("--micro-batch", type=int, default=1,
                   help="sequences per forward; accum / micro-batch micro-batches per optimizer step")
    p.add_argument("--trace-dir", type=Path, default=None,
                   help="where the profiled step's Chrome traces and top-kernel lists go (default: a temp dir)")
    p.add_argument("--keep-traces", action="store_true",
                   help="keep the Chrome traces (large); the top-kernel lists are always kept")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="one more, profiled step per setup for the GPU-time shares (--no-profile: skip it, for "
                        "steps of many micro-batches, whose traces take minutes to write)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the setups this many times, in reversed order every other round (ABBA...), and "
                        "report the median of each setup's rounds and every round's ratios: a board's drift "
                        "over the run then falls on every setup alike; the profile runs in the first round")
    p.add_argument("--sustain-s", type=float, default=5.0,
                   help="seconds of GEMMs before timing the power-capped GEMM ceiling")
    p.add_argument("overrides", nargs="*", help="config overrides (key=value): model.* ones set every setup's shapes "
                   "(plain ones too) and the FLOP count; the rest our trainer's")
    args = p.parse_args(argv)
    install_inductor_barrier()  # for the plain compiled setups too (our engine installs it itself)
    cfg = load_config(args.config, args.overrides)  # model.* overrides give every setup the same shapes
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: run each setup at least once (1, the default)")
    if args.micro_batch < 1 or args.accum % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide --accum {args.accum}")
    micro, n_micro = args.micro_batch, args.accum // args.micro_batch
    peak, peak_src = peak_flops(torch.device("cuda"))
    gemm = measure_gemm_ceiling(torch.device("cuda"))
    telemetry = GpuTelemetry.open(torch.device("cuda"))
    if telemetry is not None:
        telemetry.mark()
    gemm_capped = measure_gemm_ceiling(torch.device("cuda"), iters=100, sustain_s=args.sustain_s)
    gemm_clock = (telemetry.mark() if telemetry else {}).get("gpu_sm_clock_mhz")  # over the sustained GEMMs
    if telemetry is not None:
        telemetry.close()
    trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="e2e_"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    setups = args.setups.split(",")
    results = {setup: [] for setup in setups}
    for rnd, setup in setup_order(setups, args.rounds):
        r = run_setup(args, setup, n_micro, micro, f"run{rnd}{setups.index(setup)}_{setup.split(':')[0]}",
                      trace_dir, args.profile and rnd == 0)
        results[setup].append(r)
        if args.rounds > 1:
            print(f"[e2e] round {rnd + 1}: {setup}: {r['tokens'] / r['step_s'] / 1e3:.1f}k tokens/s", flush=True)
    rows = []
    for setup in setups:
        r = combine_rounds(results[setup])
        row_cfg = load_config(args.config, [*args.overrides, *parse_setup(setup)[1]])  # this row's model shapes
        tokens = r["tokens"]  # per optimizer step, as this setup ran it
        fpt, fpt_causal = row_cfg.model.flops_per_token(), row_cfg.model.flops_per_token(causal_aware=True)
        tok_s = tokens / r["step_s"]
        rows.append((setup, r["attention"], tok_s, fpt * tok_s / 1e12, fpt_causal * tok_s / 1e12, r["mem_gb"],
                     r["attn_share"], r["mm_share"], r))
        attn_txt = f"attention {100 * r['attn_share']:.1f}% of GPU time" if r["attn_share"] is not None else "not profiled"
        print(f"[e2e] {setup}: {tok_s / 1e3:.1f}k tokens/s, {fpt * tok_s / 1e12:.0f} TFLOP/s (paper), {attn_txt}",
              flush=True)
        if "gpu_power_capped" in r:  # our trainer's telemetry: why the SM clock sat below its maximum
            temps = "".join(f", {label} {r[key]:.0f} C" for key, label in (("gpu_temp_c", "GPU"), ("gpu_mem_temp_c", "HBM"))
                            if key in r)
            print(f"[e2e] {setup}: SM clock held down by the power limit in {100 * r['gpu_power_capped']:.0f}% "
                  f"of busy samples, by hardware slowdown in {100 * r.get('gpu_hw_slowdown', 0):.0f}%, by thermal "
                  f"limits in {100 * r.get('gpu_thermal_capped', 0):.0f}%{temps}", flush=True)
    if args.rounds > 1:
        print_round_ratios(setups, results)
    print(f"\n{args.config}: {cfg.model.num_params() / 1e6:.1f}M params, seq {cfg.model.seq_len}, "
          f"{n_micro} x {micro} micro-batches per step | {torch.cuda.get_device_name()} | torch {torch.__version__}"
          f" | traces {trace_dir} | peak {peak_src} | measured bf16 GEMM ceiling {gemm / 1e12:.0f} TFLOP/s"
          f" (cold GPU, full clock), {gemm_capped / 1e12:.0f} TFLOP/s after {args.sustain_s:g} s of GEMMs"
          + (f" (SM clock {gemm_clock:.0f} MHz: the board power limit)" if gemm_clock else ""))
    base = next((r[3] for r in rows if r[0] == "eager_cudnn"), None)
    plain = [r for r in rows if not r[0].startswith("ours")]
    best = max(plain, key=lambda r: r[3]) if plain else None  # the fastest plain-PyTorch step of this run
    print("| setup | attention | tokens/s | TFLOP/s (paper) | TFLOP/s (causal) | MFU vs peak | vs GEMM ceiling "
          "(cold / sustained) | peak mem GB | GPU time: attention / matmul / other | GPU busy | SM MHz / W / mJ "
          "per token | log vs CUDA events | ratio vs eager_cudnn | ratio vs best plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for setup, attn, tok_s, tf, tfc, mem, share, mm, r in rows:
        ratio = f"{tf / base:.3f}" if base else "-"
        ratio_best = f"{tf / best[3]:.3f} ({best[0]})" if best else "-"
        # our trainer's figure is its log's (host clocks); the events time the same steps on the GPU:
        # the log's throughput relative to the events' (and the events' tokens/s)
        agree = (f"{r['event_step_s'] / r['step_s'] - 1:+.2%} ({r['tokens'] / r['event_step_s'] / 1e3:.1f}k)"
                 if r.get("event_step_s") else "-")
        mfu = f"{100 * tf * 1e12 / peak:.1f}%" if peak else "n/a"
        power = (f"{r['gpu_sm_clock_mhz']:.0f} / {r['gpu_power_w']:.0f} / {1e3 * r['gpu_j_per_token']:.1f}"
                 if "gpu_sm_clock_mhz" in r and "gpu_j_per_token" in r else "n/a")
        # the profiled step's summed kernel time over the median unprofiled step time: the GPU's busy
        # share (100% minus it bounds what removing launch gaps, e.g. with CUDA graphs, could give)
        busy = f"{100 * r['kernel_s'] / r['step_s']:.1f}%" if r.get("kernel_s") else "n/a"
        split = (f"{100 * share:.1f}% / {100 * mm:.1f}% / {100 * (1 - share - mm):.1f}%" if share is not None
                 else "not profiled")
        print(f"| {setup} | {attn} | {tok_s / 1e3:.1f}k | {tf:.0f} | {tfc:.0f} | {mfu} | "
              f"{100 * tf * 1e12 / gemm:.1f}% / {100 * tf * 1e12 / gemm_capped:.1f}% | {mem:.1f} | "
              f"{split} | {busy} | {power} | {agree} | {ratio} | {ratio_best} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
