"""bench/long_context.sh's memory ladder, run on CPU with a stand-in `torchrun` that fails by the run's name:
each longer window climbs the rungs (as configured, recomputed, with FSDP2, blocks recomputed) until one
trains, starts at the rung the last window needed, and the sweep stops at the first window no rung fits;
windows past 64k read the repeated corpus. Nothing trains: the stand-in records its arguments."""
import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

STUB = """#!/usr/bin/env bash
name=$(printf '%s\\n' "$@" | sed -n 's/^train.run_name=//p')
printf '%s\\n' "$name $*" >> "$STUB_CALLS"
case " $STUB_OOM " in *" $name "*) echo "out of GPU memory after 0 completed steps (stub)"; exit 2;; esac
case " $STUB_FAIL " in *" $name "*) echo "config error: something else (stub)"; exit 2;; esac
exit 0
"""


def _run(tmp_path: Path, oom: str, longest: str, only: str, fail: str = ""):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "torchrun"
    stub.write_text(STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    python_dir = Path(sys.executable).parent  # python3 in the script: this interpreter (the project's)
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PATH": f"{bin_dir}:{python_dir}:{os.environ['PATH']}", "STUB_CALLS": str(calls),
           "STUB_OOM": oom, "STUB_FAIL": fail, "LONGEST": longest, "ONLY": only}
    proc = subprocess.run(["bash", "bench/long_context.sh", str(tmp_path / "out")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return proc, {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines}, [ln.split(" ")[0] for ln in lines]


def test_ladder_climbs_then_starts_higher_and_stops(tmp_path):
    windows = ("c4_128k", "c4_256k", "c4_512k")
    rungs = ("", "_recompute", "_fsdp", "_blocks")
    only = " ".join(w + r for w in windows for r in rungs)
    oom = "c4_256k c4_256k_recompute c4_512k_fsdp c4_512k_blocks"
    proc, args, order = _run(tmp_path, oom, "131072 262144 524288", only)
    # 128k trains as configured; 256k needs FSDP2; 512k starts there and no rung fits: the sweep ends
    assert order == ["c4_128k", "c4_256k", "c4_256k_recompute", "c4_256k_fsdp", "c4_512k_fsdp",
                     "c4_512k_blocks"], proc.stdout + proc.stderr
    assert "c4_512k_blocks: out of GPU memory" in proc.stdout
    assert "model.recompute_blocks=true engine.parallel=fsdp" in args["c4_512k_blocks"]
    fsdp = args["c4_256k_fsdp"]
    assert "model.seq_len=262144" in fsdp and "engine.parallel=fsdp" in fsdp and "recompute_attention=true" in fsdp
    corpus = tmp_path / "out" / "corpus_x8"
    assert f"data.source=[{corpus}]" in args["c4_128k"]
    for f in (REPO / "data" / "corpus").glob("*.jsonl"):  # 8 copies of each shipped file
        assert (corpus / f.name).read_bytes() == f.read_bytes() * 8


def test_a_failure_other_than_memory_ends_the_sweep(tmp_path):
    """A run that fails otherwise than by memory tries no further rung and no longer window."""
    proc, _, order = _run(tmp_path, "", "131072 262144", "c4_128k c4_128k_recompute c4_256k", fail="c4_128k")
    assert order == ["c4_128k"], proc.stdout + proc.stderr
    assert "c4_128k: FAILED" in proc.stdout
