"""The training loop: micro-batches, gradient accumulation, optimizer steps, evaluation, checkpoints,
metrics. Everything it drives is built by `Trainer.build` from one resolved Config.

Reliability (README "Errors and what to do"): a non-finite loss or gradient norm is caught before the
optimizer step (train.nonfinite=skip|stop); SIGTERM/SIGINT stop every rank at the same micro-batch
boundary with the checkpoint of the last finished step; a rank that stops making progress ends the job
(training/resilience/watchdog.py); auto-resume falls back past damaged checkpoints
(training/resilience/checkpoint.py)."""
from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Optional, Tuple

import torch

from data.loader import PackedLoader
from data.prepare import prepare
from model.attention import AttentionUnavailable
from model.config import GPTConfig
from model.gpt import GPT
from training.config import (Config, ConfigError, check_context_parallel, grad_accum_steps, save_resolved,
                             to_dict, zero3_partitions_modules)
from training.context_parallel import attach
from training.context_parallel.groups import ContextLayout, context_layout
from training.context_parallel.slicing import slice_batch
from training.distributed import DistInfo, control_store, rank0_first, stop_group
from training.engines.base import autocast_dtype
from training.engines.factory import build_engine
from training.engines.replicas import TorchEngine
from training.gradient_check import GradientLostError, attention_weights_without_gradient, lost_gradient_message
from training.resilience import faults
from training.resilience.checkpoint import (CheckpointError, Checkpointer, IncompatibleCheckpoint, on_main,
                                            rng_state, set_rng_state)
from training.resilience.determinism import make_deterministic
from training.resilience.run_folder import RunLock, move_aside
from training.resilience.signals import StopSignal
from training.resilience.watchdog import HangWatchdog
from training.telemetry.gpu import GpuTelemetry
from training.telemetry.logging import RunLogger
from training.telemetry.metrics import DeferredScalars, ThroughputMeter, memory_stats, peak_flops
from training.telemetry.profiling import profile_call

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient norm (train.nonfinite)."""


# model.* keys that choose how the same function is computed, not which weights or function: a run
# may resume with other values (e.g. model.attention=sdpa after flash, model.residual=fp32, or without
# the activation-memory options).
IMPLEMENTATION_KEYS = ("attention", "recompute_attention", "mlp", "fused_loss", "residual", "recompute_gelu",
                       "recompute_gelu_layers", "recompute_blocks", "norm_saves_output", "fused_add_norm")


def check_compatible(saved: dict, cfg: Config, path: Path) -> None:
    """A checkpoint resumes only a run of the same model (shapes and function) and data. A key the
    checkpoint predates counts as its default value (checkpoints of older versions still resume)."""
    defaults = dataclasses.asdict(GPTConfig())
    then, now = {**defaults, **saved["model"]}, {**defaults, **to_dict(cfg)["model"]}
    diff = {k: (then.get(k), now.get(k)) for k in sorted(set(then) | set(now))
            if k not in IMPLEMENTATION_KEYS and then.get(k) != now.get(k)}
    if diff:
        raise IncompatibleCheckpoint(f"{path} holds a model of another shape ({diff}, saved vs now); resume with "
                              f"the same model.* settings or start a new run (train.run_name=...)")


class Trainer:
    def __init__(self, cfg: Config, dist: DistInfo, engine, train_loader: PackedLoader,
                 val_loader: Optional[PackedLoader], data_meta: dict, context: Optional[ContextLayout] = None):
        self.cfg, self.dist, self.engine = cfg, dist, engine
        # engine.context_parallel_size: this rank's slice of each window (training/context_parallel/)
        self.context = context or ContextLayout(1, 0, dist.rank, dist.world_size, None)
        self.train_loader, self.val_loader, self.data_meta = train_loader, val_loader, data_meta
        self.run_dir = Path(cfg.train.out_dir) / cfg.train.run_name
        self.accum = grad_accum_steps(cfg, dist.world_size)
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
        self.checkpointer = Checkpointer(self.run_dir, cfg.train.keep_last, dist, cfg.train.resume_unverified)
        self._lock: Optional[RunLock] = None  # rank 0's lock on the run folder, held by fit()
        self.step, self.tokens_seen, self.wandb_id = 0, 0, None
        self.skipped_steps = self.consecutive_skips = 0  # non-finite steps: in total, in a row now
        self.gradients_checked = False  # the attention's gradients, after this process's first backward
        self.abandoned_after = 0  # micro-batches of the step a signal stopped (train_step)
        self.watchdog: Optional[HangWatchdog] = None  # several ranks with train.hang_timeout_s > 0 (fit)
        faults.install(engine.model, lambda: self.step + 1, dist.rank)  # tests only: nan_*, lost_grad

    @classmethod
    def build(cls, cfg: Config, dist: DistInfo) -> "Trainer":
        t = cfg.train
        # Data: rank 0 tokenizes and writes shards; the others then find them in the cache (they wait
        # through the store, with no time limit: no collective timeout can end a long first run's wait).
        prepared = rank0_first(dist, "preparing the data", lambda: prepare(cfg.data, cfg.model.vocab_size))
        check_context_parallel(cfg, dist.world_size)
        context = context_layout(dist, cfg.engine.context_parallel_size)
        # the loaders are sharded over the data-parallel ranks: a context group's ranks read the same windows
        common = dict(seq_len=cfg.model.seq_len, micro_batch_size=t.micro_batch_size, rank=context.data_rank,
                      world_size=context.data_size, eos_id=prepared.eos_id, doc_boundaries=cfg.data.doc_boundaries)
        train_loader = PackedLoader(prepared.dir, "train", seed=t.seed, num_workers=cfg.data.num_workers,
                                    epoch_multiple=t.global_batch_size, **common)
        val_loader = None
        if t.eval_interval > 0 and t.eval_steps > 0:
            val_loader = PackedLoader(prepared.dir, "val", seed=t.seed, num_workers=0, **common)
        torch.manual_seed(t.seed)  # identical initial weights on every rank
        attention_dtype = autocast_dtype(cfg, dist.device) or torch.float32
        model_cfg = cfg.model
        if zero3_partitions_modules(cfg) and model_cfg.mlp == "auto":  # the fused MLP reads fc / proj
            model_cfg = dataclasses.replace(model_cfg, mlp="torch")  # weights ZeRO-3 has not gathered
        try:
            model = GPT(model_cfg, device=dist.device, attention_dtype=attention_dtype)
        except AttentionUnavailable as e:  # model.attention names a backend this device cannot run
            raise ConfigError(str(e)) from None
        if t.deterministic:
            log.info(f"train.deterministic: {make_deterministic(model)}")
        if context.enabled:  # the model stays single-device: its attention gets the all-to-all wrapper
            attach(model, context.group)
        engine = build_engine(model, cfg, dist)
        torch.manual_seed(t.seed + 1000 * dist.rank)  # per-rank stream for dropout
        meta = {"tokenizer_hash": prepared.tokenizer_hash, "vocab_size": prepared.vocab_size,
                "data_dir": str(prepared.dir)}
        return cls(cfg, dist, engine, train_loader, val_loader, meta, context)

    # --- checkpoints ------------------------------------------------------------------------------
    def save(self) -> Path:
        client = {"tokens_seen": self.tokens_seen, "config": to_dict(self.cfg), "wandb_id": self.wandb_id,
                  "data": self.data_meta, "skipped_steps": self.skipped_steps,
                  "consecutive_skips": self.consecutive_skips}
        rank_state = {"loader": self.train_loader.state_dict(), "rng": rng_state()}
        return self.checkpointer.save(self.step, self.engine, client, rank_state)

    def _check_resumable(self, client: dict, path: Path) -> None:
        """Same model (shapes and function) and same data as this run, else IncompatibleCheckpoint."""
        check_compatible(client["config"], self.cfg, path)
        if client["data"]["tokenizer_hash"] != self.data_meta["tokenizer_hash"]:
            raise IncompatibleCheckpoint(f"{path} was trained with another tokenizer ({client['data']['tokenizer_hash']}"
                                         f" vs {self.data_meta['tokenizer_hash']}); resume with the same data.* "
                                         f"settings or start a new run")

    def maybe_resume(self) -> Optional[Path]:
        found = self.checkpointer.resume(self.cfg.train.resume, self.engine, self._check_resumable)
        if found is None:
            return None
        path, client, rank_state = found
        self.step, self.tokens_seen = client["step"], client["tokens_seen"]
        self.wandb_id = client.get("wandb_id")
        self.skipped_steps = client.get("skipped_steps", 0)
        self.consecutive_skips = client.get("consecutive_skips", 0)
        self.train_loader.load_state_dict(rank_state["loader"])
        saved_c = client["config"].get("engine", {}).get("context_parallel_size", 1)
        if saved_c != self.context.size and self.dist.is_main:
            log.warning("resuming %s (saved with engine.context_parallel_size=%d) with context_parallel_size=%d: "
                        "the same weights, optimizer and data order; the loss curve continues, not bit for bit",
                        path, saved_c, self.context.size)
        if rank_state["resharded_from"]:  # other rank count: RNG streams per rank start afresh
            log.warning("resuming %s (saved on %d ranks) on %d ranks: the loss curve continues, but not "
                        "bit for bit (the accumulation order changes)", path, rank_state["resharded_from"],
                        self.dist.world_size)
            torch.manual_seed(self.cfg.train.seed + 1000 * self.dist.rank + self.step)
        else:
            set_rng_state(rank_state["rng"])
        return path

    # --- the run folder ---------------------------------------------------------------------------
    def _take_run_folder(self) -> None:
        """Rank 0: lock the run folder (one run at a time), then remove leftovers of crashed saves."""
        self._lock = RunLock(self.run_dir).acquire()
        gone = self.checkpointer.remove_leftovers()
        if gone:
            log.info(f"removed leftovers of an interrupted save or prune in {self.checkpointer.root}: {', '.join(gone)}")

    def _starts_afresh(self) -> bool:
        """Whether this start ignores the run folder's own checkpoints: train.resume=none, or a path
        outside this run's checkpoints folder."""
        resume = self.cfg.train.resume
        if resume == "auto":
            return False
        if resume == "none":
            return True
        root = self.checkpointer.root.resolve()
        return root not in Path(resume).resolve().parents

    def _clear_for_fresh_start(self) -> None:
        """Rank 0: a fresh run into a folder that holds checkpoints stops, or with train.overwrite=true
        moves the old run's files aside first (pruning would otherwise delete them, and `latest` would
        mix two runs)."""
        old = self.checkpointer.complete()
        if not old:
            return
        if not self.cfg.train.overwrite:
            raise CheckpointError(
                f"run folder {self.run_dir} already holds checkpoints ({', '.join(p.name for p in old[-3:])}) and "
                f"train.resume={self.cfg.train.resume} starts a new run there: choose a new train.run_name, or "
                f"train.resume=auto to continue the old run, or train.overwrite=true to move the old run's files "
                f"to {self.run_dir}/replaced-<time>/ first")
        aside = move_aside(self.run_dir)
        log.warning(f"train.overwrite=true: moved the old run's files ({len(old)} checkpoints, metrics, W&B) "
                    f"from {self.run_dir} to {aside}")

    def _release_run_folder(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # --- the loop ---------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        self.engine.model.eval()
        self.val_loader.reset()
        total = torch.zeros((), device=self.dist.device)
        for _ in range(self.cfg.train.eval_steps):
            total += self.engine.eval_loss(slice_batch(self.val_loader.next_batch(), self.context)).float()
        self.engine.model.train()
        return float(self.dist.all_reduce_mean(total / self.cfg.train.eval_steps))

    def train_step(self, signals: StopSignal) -> Tuple[Optional[dict], bool]:
        """One optimizer step over `accum` micro-batches; values stay on the device. Returns the
        metrics and whether any rank asked to stop (a signal); (None, True) when the ranks agreed to
        stop at a micro-batch boundary before the step finished (see `_abandon`).

        Before each micro-batch, `signals.agreed()`: a 4-byte gloo all-reduce on the host. Engines
        that cannot drop part of a step's gradients (DeepSpeed counts micro-steps itself) ask only
        before the first one. Before the update, one fused check: [loss or grad norm non-finite, stop
        requested], MAX all-reduced over ranks (so all ranks agree, also when gradients are sharded),
        read on the host once. The step must branch on it, so this is one device sync per step: on a
        GPU the host cannot queue the optimizer step until backward has finished (costs the launch
        latency of the optimizer step, well under 1% of a step of a large model)."""
        where = self.train_loader.state_dict()  # epoch / position of this step's first batch
        rng = rng_state()  # and the RNG streams: an abandoned step reruns from exactly here on resume
        loss_sum = torch.zeros((), device=self.dist.device)
        can_drop = isinstance(self.engine, TorchEngine)  # its gradients live on the parameters
        for micro in range(self.accum):
            if (micro == 0 or can_drop) and signals.agreed():
                self._abandon(micro, where, rng)
                return None, True
            batch = slice_batch(self.train_loader.next_batch(), self.context)
            loss_sum += self.engine.forward_backward(batch, sync=micro == self.accum - 1).float()
            if micro == 0:
                faults.reach("first_micro_batch", self.step + 1, self.dist.rank)  # tests only
            if self.watchdog is not None:
                self.watchdog.at(micro + 1)
        if not self.gradients_checked:
            self._check_attention_gradients()
        # mean over all ranks: a context group's slices are of equal size, so their mean is the window's
        loss = self.dist.all_reduce_mean(loss_sum / self.accum)
        faults.reach("update", self.step + 1, self.dist.rank)  # tests only
        grad_norm = self._grad_norm()
        flags = torch.stack([(~torch.isfinite(loss) | ~torch.isfinite(grad_norm)).float(),
                             torch.tensor(float(signals.requested), device=loss.device)])
        if self.dist.enabled:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        nonfinite, stop = (bool(v) for v in flags.tolist())
        if nonfinite:
            self._skip_step(float(loss), float(grad_norm), where)
            stats = {"grad_norm": grad_norm, "lr": self.engine.lr, "skipped": 1}
        else:
            self.consecutive_skips = 0
            stats = self.engine.step()
        return {"loss": loss, **stats, "skipped_steps": self.skipped_steps}, stop

    def _abandon(self, done: int, where: dict, rng: dict) -> None:
        """Stop inside a step after `done` micro-batches: drop their gradients and put the loader and
        the RNG streams back to the step's start, so the checkpoint of the last finished step is what
        an uninterrupted run held after it (the abandoned step reruns identically on resume)."""
        self.abandoned_after = done
        if done == 0:
            return
        self.engine.model.zero_grad(set_to_none=True)
        self.engine.optimizer.zero_grad(set_to_none=True)
        self.train_loader.load_state_dict(where)
        set_rng_state(rng)

    def _check_attention_gradients(self) -> None:
        """Once per process, after the first step's backward: every attention layer's q/k/v weight has a
        gradient (training/gradient_check.py); GradientLostError on every rank if one rank misses one.
        Engines whose gradients live on the parameters only (DeepSpeed keeps its own)."""
        self.gradients_checked = True
        if not isinstance(self.engine, TorchEngine):
            return
        missing = attention_weights_without_gradient(self.engine.model)
        flag = torch.tensor(float(bool(missing)), device=self.dist.device)
        if self.dist.enabled:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item():
            raise GradientLostError(lost_gradient_message(missing or ["another rank's attention weights"]))

    def _grad_norm(self) -> torch.Tensor:
        """Global L2 norm of this rank's gradients (an engine may provide its own `grad_norm()`;
        sharded DTensor grads count their local shard: the flag all-reduce then covers all ranks)."""
        if hasattr(self.engine, "grad_norm"):
            return self.engine.grad_norm()
        grads = [g.to_local() if hasattr(g, "to_local") else g
                 for g in (p.grad for p in self.engine.model.parameters()) if g is not None]
        if not grads:
            return torch.zeros((), device=self.dist.device)
        return torch.nn.utils.get_total_norm(grads).float()

    def _skip_step(self, loss: float, grad_norm: float, where: dict) -> None:
        """A non-finite step: raise (nonfinite=stop, or too many in a row), else drop its gradients.
        The step still counts (data order stays a function of the step); the optimizer and the LR
        schedule do not advance (as Megatron and DeepSpeed skip fp16 overflow steps)."""
        t = self.cfg.train
        self.skipped_steps += 1
        self.consecutive_skips += 1
        at = (f"step {self.step + 1} (loss {loss}, grad norm {grad_norm}; its batches start at epoch "
              f"{where['epoch']}, window {where['position']} of the train split, train.seed={t.seed})")
        if t.nonfinite == "stop":
            raise NonFiniteError(f"non-finite loss or gradient norm at {at} and train.nonfinite=stop; "
                                 f"resume from the last checkpoint with a lower optim.lr, or set "
                                 f"train.nonfinite=skip to drop such steps")
        if self.consecutive_skips > t.max_skipped:
            raise NonFiniteError(f"{self.consecutive_skips} steps in a row had a non-finite loss or "
                                 f"gradient norm (more than train.max_skipped={t.max_skipped}), the last "
                                 f"at {at}; the run diverged: resume from an earlier checkpoint with a "
                                 f"lower optim.lr")
        if self.dist.is_main:
            log.warning(f"skipped {at}: non-finite loss or gradient norm ({self.skipped_steps} skipped "
                        f"so far, {self.consecutive_skips} in a row)")
        skip = getattr(self.engine, "skip_step", None)
        if skip is not None:  # an engine with its own bookkeeping (e.g. DeepSpeed's micro-step count)
            skip()
        elif isinstance(self.engine, TorchEngine):  # grads live on the parameters (DDP, FSDP2)
            self.engine.model.zero_grad(set_to_none=True)
            self.engine.optimizer.zero_grad(set_to_none=True)
        else:
            raise NonFiniteError(f"non-finite loss or gradient norm at {at}; {type(self.engine).__name__} "
                                 f"cannot skip a step (it has no skip_step()), so the run stops here")

    def fit(self) -> None:
        """Take the run folder (lock, leftovers), resume or start afresh, train. The lock is released
        however the run ends."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            on_main(self.dist, self._take_run_folder)
            if self._starts_afresh():
                on_main(self.dist, self._clear_for_fresh_start)
            resumed = self.maybe_resume()
            if resumed is not None and self.step >= self.cfg.train.max_steps:
                if self.dist.is_main:
                    log.warning(f"nothing to train: {resumed} is at step {self.step} and train.max_steps="
                                f"{self.cfg.train.max_steps}. To train further, rerun with a larger "
                                f"train.max_steps (e.g. train.max_steps={2 * self.cfg.train.max_steps}); to "
                                f"start over, train.resume=none train.overwrite=true or a new train.run_name")
                return
            self._train(resumed)
        finally:
            self._release_run_folder()

    def _train(self, resumed: Optional[Path]) -> None:
        cfg, t = self.cfg, self.cfg.train
        if self.dist.is_main:
            save_resolved(cfg, self.run_dir / "config.yaml")
        peak, peak_src = peak_flops(self.dist.device)
        meter = ThroughputMeter.from_model(cfg.model, self.tokens_per_step, self.dist.world_size, peak=peak)
        logger = RunLogger(cfg, self.run_dir, self.dist.rank, t.max_steps, self.step, self.wandb_id)
        self.wandb_id = logger.wandb_id
        logger.info(self._banner(resumed, peak_src))
        deferred = DeferredScalars()
        stop_at = t.max_steps if t.stop_after is None else min(t.max_steps, self.step + t.stop_after)
        telemetry = GpuTelemetry.open(self.dist.device)  # SM clock / power / energy; None on CPU

        def restart_intervals():  # keep evaluation and checkpoint time out of the per-step figures
            meter.mark(self.step)
            if telemetry is not None:
                telemetry.mark()

        restart_intervals()
        signals = StopSignal(stop_group(self.dist))
        self.watchdog = watchdog = self._watchdog()
        saved = (self.step, resumed)  # the newest checkpoint: (its step, its folder)
        try:
            signals.__enter__()
            while self.step < stop_at:
                if self.step + 1 == t.profile_step:  # one step under the profiler
                    trace = self.run_dir / f"profile_step_{t.profile_step}.json"
                    (values, stop), shares = profile_call(lambda: self.train_step(signals),
                                                          self.dist.device, trace)
                    if values is not None:
                        values = {**values, **shares}
                        logger.info(f"profiled step {t.profile_step}: " + ", ".join(
                            f"{k.removeprefix('time_share_')} {100 * v:.1f}%" for k, v in shares.items()
                            if k.startswith("time_share_"))
                            + f" of {'kernel' if self.dist.device.type == 'cuda' else 'operator'} time; "
                            f"trace {trace}")
                else:
                    values, stop = self.train_step(signals)
                if values is not None:  # the step finished (None: abandoned on a signal)
                    self.step += 1
                    self.tokens_seen += self.tokens_per_step
                    self._mark(watchdog, f"step {self.step + 1}")
                    if logger.should_log(self.step):
                        timing = meter.mark(self.step) or {}
                        if telemetry is not None:  # tokens this GPU ran since the last mark
                            timing.update(telemetry.mark(meter.interval_steps * self.tokens_per_step // self.dist.world_size))
                        deferred.push(self.step, {**values, **timing, "tokens_seen": self.tokens_seen,
                                                  **memory_stats(self.dist.device)})
                    for step, metrics in deferred.pop_ready():
                        logger.log(step, metrics)
                    if self._due(t.eval_interval) and self.val_loader is not None:
                        self._mark(watchdog, f"evaluation after step {self.step}")
                        logger.log_eval(self.step, {"loss": self.evaluate(), "tokens_seen": self.tokens_seen})
                        self._mark(watchdog, f"step {self.step + 1}")
                        restart_intervals()
                if self._due(t.ckpt_interval) or (self.step == stop_at and (t.save_final or self.step < t.max_steps)) or stop:
                    for step, metrics in deferred.flush():
                        logger.log(step, metrics)
                    if saved[0] != self.step:  # not again (a stop right after a save or resume)
                        self._mark(watchdog, f"checkpoint save of step {self.step}")
                        saved = (self.step, self.save())
                        logger.info(f"checkpoint: {saved[1]}")
                        self._mark(watchdog, f"step {self.step + 1}")
                        restart_intervals()
                if stop:  # every rank saw the same flag: all stop here
                    logger.info(self._stopped(signals.received, saved[1] if saved[0] == self.step else None,
                                              values is None))
                    break
        finally:
            signals.__exit__()
            if watchdog is not None:
                watchdog.close()
                self.watchdog = None
            if telemetry is not None:
                telemetry.close()
            for step, metrics in deferred.flush():  # also when an error stops the run
                logger.log(step, metrics)
            logger.close(exit_code=0 if sys.exc_info()[0] is None else 1)  # W&B marks a run an error stopped
            self.train_loader.close()

    def _stopped(self, received: Optional[str], path: Optional[Path], abandoned: bool) -> str:
        """The log line of a stop on a signal."""
        why = received or "stop signal (another rank)"
        where = f"with checkpoint {path}" if path else "before any step finished (nothing to save)"
        part = (f" (step {self.step + 1} was abandoned after {self.abandoned_after} of {self.accum} "
                f"micro-batches; it reruns on resume)" if abandoned and self.abandoned_after else "")
        return f"{why} received: stopped at step {self.step} {where}{part}; rerun the same command to resume"

    # --- hang watchdog (training/resilience/watchdog.py) --------------------------------------------------------
    def _watchdog(self) -> Optional[HangWatchdog]:
        t = self.cfg.train
        if not self.dist.enabled or t.hang_timeout_s <= 0:
            return None
        return HangWatchdog(t.hang_timeout_s, self.dist.rank, self.dist.world_size, control_store(),
                            self.step, self._rerun_hint).start()

    def _mark(self, watchdog: Optional[HangWatchdog], doing: str) -> None:
        if watchdog is not None:
            watchdog.mark(self.step, doing)

    def _rerun_hint(self) -> str:
        done = self.checkpointer.complete()
        if not done:
            return "No checkpoint yet: rerunning the same command starts the run afresh."
        how = "the same command" if self.cfg.train.resume == "auto" else "with train.resume=auto"
        return f"Rerun {how}: it continues from {done[-1]}."

    def _due(self, interval: int) -> bool:
        return interval > 0 and self.step % interval == 0

    def _engine_banner(self) -> str:
        """' | <engine>' and how it reduces gradients, e.g. ' | DDP', ' | FSDP2', ' | DeepSpeed ZeRO-2',
        ' | single process', ' | DDP (gradients summed after the backward) | weight cache'."""
        sync = getattr(self.engine, "grad_sync", None)
        if self.cfg.engine.type == "deepspeed":
            name = f"DeepSpeed ZeRO-{self.cfg.engine.zero_stage}"
        elif self.cfg.engine.parallel == "fsdp":
            name = "FSDP2"
        elif sync is None:
            name = "single process"
        else:
            name = "DDP" + {"after_backward": " (gradients summed after the backward)",
                            "during_backward": " (gradients summed as the last backward writes them)"}.get(sync, "")
        cache = getattr(self.engine, "weight_cache", None)
        if cache is None:
            return f" | {name}"
        return f" | {name} | weight cache" + (" + fp32 weight gradients" if cache.accumulated else "")

    def _context_banner(self) -> str:
        """' (context C x data D)' with engine.context_parallel_size > 1, else ''."""
        c = self.context
        return f" (context {c.size} x data {c.data_size})" if c.enabled else ""

    def _banner(self, resumed: Optional[Path], peak_src: str) -> str:
        c = self.cfg
        return (f"run {self.run_dir} | {c.model.n_layer}L d{c.model.d_model} h{c.model.n_head} "
                f"seq {c.model.seq_len} | {c.model.num_params() / 1e6:.2f}M params | attention "
                f"{self.engine.model.attention_backend}"
                f"{' (recomputed in backward)' if c.model.recompute_attention and not c.model.recompute_blocks else ''}"
                f"{' | blocks recomputed in backward' if c.model.recompute_blocks else ''}"
                + (f", local band of {c.model.attention_window} tokens in {c.model.attention_window_layers} layers"
                   if c.model.attention_window else "") +
                f" | MLP {getattr(self.engine.model, 'mlp_impl', 'torch')}"
                f"{' | torch.compile' if self.engine.compiled else ''}"
                f"{self._engine_banner()} | "
                f"{self.dist.world_size} rank(s){self._context_banner()} on "
                f"{self.dist.device if self.dist.world_size == 1 else self.dist.device.type + ' (a device per rank)'}"
                f" | micro-batch {c.train.micro_batch_size} x accum {self.accum} = "
                f"global {c.train.global_batch_size} seqs | peak: {peak_src} | "
                + (f"resumed from {resumed} at step {self.step}" if resumed else "fresh start"))
