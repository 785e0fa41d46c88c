"""Run logging on rank 0: console progress bar, metrics.jsonl in the run folder, Weights & Biases.

No backend failure ever stops training: each backend warns once and the run goes on. W&B runs
offline by default, keeps its files under run_dir/wandb, and continues the same run id on resume
(store `RunLogger.wandb_id` in checkpoints), in the group and with the tags of logging.group /
logging.tags. Train metrics are logged under their own names ("loss", "mfu_paper", ...); evaluation
metrics under "eval/<name>". Every metric has the step's tokens (key "tokens_seen") as its W&B x-axis
(define_metric step_metric), and the W&B step stays the optimizer step. When the run ends, the
steady-state medians of training/telemetry/summary.py go into the W&B run's summary and into
<run_dir>/summary.json.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import string
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

from training.telemetry.metrics import format_mfu
from training.telemetry.summary import PEAK_MEM_KEY, STEADY_KEYS, read_jsonl, steady_summary, write_summary

# W&B summaries so runs line up side by side in the runs table.
WANDB_SUMMARIES = {"loss": "min,last", "eval/loss": "min,last", "tokens_per_s": "mean",
                   "tokens_per_s_per_gpu": "mean", "tflops_paper": "mean", "tflops_causal": "mean",
                   "mfu_paper": "mean", "mfu_causal": "mean", "step_time_s": "mean",
                   "gpu_sm_clock_mhz": "mean", "gpu_power_w": "mean", "gpu_j_per_token": "mean"}
STEP_METRIC = "tokens_seen"  # the x-axis W&B offers for every metric (define_metric step_metric)
# what a train record keeps in memory for the summary (used where metrics.jsonl is not written)
_SUMMARY_FIELDS = ("step", "loss", PEAK_MEM_KEY) + STEADY_KEYS


def _config_dict(cfg: Any) -> dict:
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    try:
        from omegaconf import OmegaConf
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:
        return dict(cfg)


def _clean(v: Any) -> Any:
    """Plain scalar: 0-d tensors and numpy numbers to float (NaN/inf stay floats; Python's json
    writes and reads them as NaN/Infinity), anything else non-numeric to str."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f


def new_run_id(length: int = 8) -> str:
    """A W&B-style run id: lowercase letters and digits."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only records with step <= last_step (all gone when last_step is 0), atomically."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a torn last line from a crash
            continue
        if last_step > 0 and rec.get("step", math.inf) <= last_step:
            kept.append(line)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class RunLogger:
    def __init__(self, cfg, run_dir: Path, rank: int, total_steps: int, start_step: int = 0,
                 wandb_id: Optional[str] = None):
        self.cfg, self.run_dir, self.rank = cfg, Path(run_dir), rank
        self.total_steps, self.start_step = total_steps, start_step
        self.log_interval = cfg.logging.log_interval
        self.wandb_id = wandb_id  # the W&B run id (store it in checkpoints)
        self.active = rank == 0
        self._warned: set = set()
        self._bar = self._jsonl = self._wandb = None
        self._defined: set = set()  # metrics given their W&B definition in this process
        self._records: list = []  # this process's train records, _SUMMARY_FIELDS only
        self.summary: Optional[dict] = None  # the steady-state summary, set by close()
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.logging.jsonl:
            path = self.run_dir / "metrics.jsonl"
            self._guard("jsonl", truncate_jsonl, path, start_step)
            self._jsonl = self._guard("jsonl", open, path, "a")
        if cfg.logging.wandb != "disabled":
            self._guard("wandb", self._init_wandb, cfg.logging.wandb)
        if cfg.logging.progress:  # after W&B init, so its start-up time stays out of the ETA
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             file=sys.stderr)

    # --- backends -------------------------------------------------------------------------
    def _warn_once(self, backend: str, err: BaseException) -> None:
        if backend not in self._warned:
            self._warned.add(backend)
            msg = f"warning: {backend} logging failed ({type(err).__name__}: {err}); training goes on"
            try:
                self.info(msg)
            except Exception:  # the console itself may be what failed
                print(msg, file=sys.__stderr__, flush=True)

    def _guard(self, backend: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            self._warn_once(backend, e)
            return None

    def _init_wandb(self, mode: str) -> None:
        try:
            import wandb
        except Exception as e:  # not installed, or broken install
            self._warn_once("wandb", e)
            return
        # W&B writes its run folders under <dir>/wandb/: dir = the run folder gives
        # <run_dir>/wandb/offline-run-*, the path README's `wandb sync` names; its caches go beside them.
        wdir = self.run_dir / "wandb"
        wdir.mkdir(parents=True, exist_ok=True)
        os.environ["WANDB_DIR"] = str(self.run_dir)
        for var, sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_DATA_DIR", "data")):
            os.environ[var] = str(wdir / sub)
        self.wandb_id = self.wandb_id or new_run_id()
        kwargs = dict(project=self.cfg.logging.project, name=self.cfg.train.run_name, id=self.wandb_id,
                      group=self.cfg.logging.group or None, tags=list(self.cfg.logging.tags) or None,
                      resume="allow", config=_config_dict(self.cfg), dir=str(self.run_dir),
                      settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        try:
            run = wandb.init(mode=mode, **kwargs)
        except Exception as e:
            if mode != "online":
                self._warn_once("wandb", e)
                return
            self.info(f"warning: W&B online init failed ({type(e).__name__}: {e}); falling back to offline")
            # The failed online run still holds this id in W&B's service ("run ID is in use"): shut the
            # service down first, or the offline retry fails too (seen with wandb 0.31, no network).
            self._guard("wandb", wandb.teardown)
            run = self._guard("wandb", wandb.init, mode="offline", **kwargs)
        if run is None:
            return
        self._wandb = run
        self._guard("wandb", run.define_metric, STEP_METRIC, summary="max")
        self._define(WANDB_SUMMARIES)
        actual = getattr(run.settings, "mode", mode)
        self.info(f"W&B run {self.wandb_id} ({actual}) in {wdir}")
        if self.start_step > 0:
            self._guard("wandb", self._log_lost_history, run, actual)

    def _log_lost_history(self, run, mode: str) -> None:
        """On resume: log again the steps up to the checkpoint that metrics.jsonl has and the W&B run
        lacks (a crash loses what W&B's service had buffered: training/telemetry/wandb_history.py). Offline, the
        run's own files say which steps it holds; online, the server's next step bounds them."""
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        if mode == "offline":
            from training.telemetry.wandb_history import logged_steps
            have, floor = logged_steps(self.run_dir / "wandb", self.wandb_id), 0
        else:
            have, floor = set(), int(getattr(run, "starting_step", 0) or 0)
        lost: Dict[int, dict] = {}
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = rec.pop("step", None)
            rec.pop("time", None)
            if isinstance(step, int) and floor <= step <= self.start_step and step not in have:
                lost.setdefault(step, {}).update(rec)
        for step in sorted(lost):
            self._define(lost[step])
            run.log(lost[step], step=step)
        if lost:
            self.info(f"W&B: logged {len(lost)} steps again ({min(lost)}-{max(lost)}) that the run lacked "
                      f"after an interrupted run; metrics.jsonl had them")

    def _define(self, names) -> None:
        """Give each metric not yet defined in this process tokens_seen as its x-axis (and its summary
        of WANDB_SUMMARIES). W&B inserts the last tokens_seen into a record that lacks it (step_sync)."""
        for name in names:
            if name not in self._defined and name != STEP_METRIC:
                self._defined.add(name)
                self._guard("wandb", self._wandb.define_metric, name, step_metric=STEP_METRIC,
                            summary=WANDB_SUMMARIES.get(name))

    # --- public API ---------------------------------------------------------------------------
    def should_log(self, step: int) -> bool:
        """Whether `step` is a logging point (every log_interval steps, and the last step)."""
        return step % self.log_interval == 0 or step == self.total_steps

    def info(self, msg: str) -> None:
        """Print a message above the progress bar (rank 0 only)."""
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def log(self, step: int, metrics: Dict[str, Any]) -> None:
        """Record train metrics of optimizer step `step` (1-based count of steps done)."""
        if not self.active:
            return
        record = {k: _clean(v) for k, v in metrics.items()}
        self._records.append({"step": step, **{k: record[k] for k in _SUMMARY_FIELDS if k in record}})
        self._write(step, record)
        self._guard("console", self._console, step, record)

    def log_eval(self, step: int, metrics: Dict[str, Any]) -> None:
        """Record evaluation metrics; keys are prefixed 'eval/' (tokens_seen, the x-axis, is not)."""
        if not self.active:
            return
        record = {(k if k.startswith("eval/") or k == STEP_METRIC else f"eval/{k}"): _clean(v)
                  for k, v in metrics.items()}
        self._write(step, record)
        self.info(f"step {step}: " + " ".join(f"{k}={_fmt(v)}" for k, v in record.items() if k != STEP_METRIC))

    def advance(self, step: int) -> None:
        """Move the progress bar to `step` without metrics."""
        if self.active and self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def _write(self, step: int, record: Dict[str, Any]) -> None:
        if self._jsonl is not None:
            line = json.dumps({"step": step, "time": time.time(), **record})
            self._guard("jsonl", lambda: (self._jsonl.write(line + "\n"), self._jsonl.flush()))
        if self._wandb is not None:
            self._define(record)
            self._guard("wandb", self._wandb.log, record, step=step)

    def _console(self, step: int, m: Dict[str, Any]) -> None:
        parts = []
        if m.get("loss") is not None:
            parts.append(f"loss={m['loss']:.4f}")
        if m.get("tokens_per_s") is not None:
            parts.append(f"tok/s={m['tokens_per_s'] / 1e3:.1f}k")
        if m.get("mfu_paper") is not None:
            parts.append(f"mfu={format_mfu(m['mfu_paper'])}")
        elif m.get("tflops_paper") is not None:
            parts.append(f"tflops={m['tflops_paper']:.3g} mfu=n/a")
        if m.get("gpu_sm_clock_mhz") is not None:  # a power-capped step runs below the full clock
            parts.append(f"sm={m['gpu_sm_clock_mhz']:.0f}MHz {m['gpu_power_w']:.0f}W")
        if self._bar is not None:
            self.advance(step)
            self._bar.set_postfix_str(" ".join(parts), refresh=True)
        elif self.should_log(step):
            print(f"step {step}/{self.total_steps} " + " ".join(parts), file=sys.stderr, flush=True)

    def close(self, exit_code: int = 0) -> None:
        if not self.active:
            return
        if self._bar is not None:
            self._guard("console", self._bar.close)
            self._bar = None
        if self._jsonl is not None:
            self._guard("jsonl", self._jsonl.close)
            self._jsonl = None
        self._guard("summary", self._summarize)
        if self._wandb is not None:
            self._guard("wandb", self._wandb.finish, exit_code=exit_code)
            self._wandb = None

    def _summarize(self) -> None:
        """The steady-state summary over the whole run: metrics.jsonl where written (it holds the
        steps of earlier sessions of a resumed run too), else this process's records. Into
        <run_dir>/summary.json and the W&B run's summary."""
        path = self.run_dir / "metrics.jsonl"
        records = read_jsonl(path) if self.cfg.logging.jsonl and path.is_file() else self._records
        self.summary = steady_summary(records, self.cfg.logging.summary_warmup_steps)
        write_summary(self.run_dir / "summary.json", self.summary)
        if self._wandb is not None:
            self._guard("wandb", self._wandb.summary.update, self.summary)

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
