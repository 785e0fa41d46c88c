"""bench/kernel_sweep.py's FlashAttention-4 column: timed beside SDPA flash and cuDNN whenever
flash_attn.cute imports (here a fake module in sys.modules), left out with one line when it does not or
with --no-fa4. The GPU work (bench_row) is replaced by a row built from the same candidate list."""
import json
import sys
import types

import pytest
import torch

import kernel_sweep


@pytest.fixture
def fake_fa4(monkeypatch):
    """A flash_attn.cute whose flash_attn_func returns (q, lse) and records its keyword arguments,
    installed as flash-attn-4 4.0.0b36."""
    calls = []

    def flash_attn_func(q, k, v, causal=False, softmax_scale=None):
        calls.append({"causal": causal, "softmax_scale": softmax_scale})
        return q * 2, None

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    parent = types.ModuleType("flash_attn")
    parent.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", parent)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    real_version = kernel_sweep.importlib.metadata.version
    monkeypatch.setattr(kernel_sweep.importlib.metadata, "version",
                        lambda name: "4.0.0b36" if name == "flash-attn-4" else real_version(name))
    return calls


@pytest.fixture
def no_fa4(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # makes the import raise ModuleNotFoundError


def test_fa4_is_a_candidate_when_importable(fake_fa4, capsys):
    fa4, version = kernel_sweep.setup_fa4(wanted=True)
    assert version == "4.0.0b36" and capsys.readouterr().out == ""
    fns = kernel_sweep.candidates(causal=True, fa4=fa4)
    assert list(fns) == ["ours", "flash", "cudnn", "fa4"]
    q = torch.ones(1, 4, 2, 64)
    out = fns["fa4"](q, q, q)  # the tuple's first element, causal and 1/sqrt(hdim) passed on
    assert torch.equal(out, q * 2) and fake_fa4 == [{"causal": True, "softmax_scale": 0.125}]
    assert "fa4" not in kernel_sweep.candidates(causal=True, only_ours=True, fa4=fa4)


def test_fa4_left_out_with_one_line(no_fa4, capsys):
    assert kernel_sweep.setup_fa4(wanted=True) == (None, None)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("FA4 not importable (ModuleNotFoundError: import of flash_attn.cute")
    assert out[0].endswith("): column left out")
    assert list(kernel_sweep.candidates(causal=False)) == ["ours", "flash", "cudnn"]


def test_fa4_not_wanted_is_silent(fake_fa4, capsys):
    assert kernel_sweep.setup_fa4(wanted=False) == (None, None)
    assert capsys.readouterr().out == ""


def run_main(monkeypatch, tmp_path, *flags):
    """kernel_sweep.main on one row with the GPU work replaced: each candidate bench_row would time
    gets fake timings (fwd 1 ms, fwd+bwd 2 ms) and errors. Returns (stdout lines, --json rows)."""
    seen = {}

    def fake_bench_row(hdim, seqlen, causal, reps, det, only_ours=False, variants=(), tokens=0,
                       queue_ahead=True, fixed_order=False, fa4=None):
        fns = kernel_sweep.candidates(causal, det, only_ours, variants, fa4)
        seen["candidates"] = list(fns)
        row = {"hdim": hdim, "causal": causal, "seqlen": seqlen, "batch": 8, "heads": 16, "err": 1e-3}
        kernel_sweep.add_tflops(row, 1e12, {n: 1.0 for n in fns}, {n: 2.0 for n in fns})
        row.update({f"err_{n}": 2e-3 for n in ("flash", "fa4") if n in fns})
        return row

    monkeypatch.setattr(kernel_sweep, "bench_row", fake_bench_row)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    out_json = tmp_path / "sweep.json"
    monkeypatch.setattr(sys, "argv", ["kernel_sweep.py", "--hdims", "128", "--seqlens", "2048", "--causal", "1",
                                      "--json", str(out_json), *flags])
    kernel_sweep.main()
    return seen["candidates"], json.loads(out_json.read_text())


def test_sweep_with_fa4(fake_fa4, monkeypatch, tmp_path, capsys):
    names, rows = run_main(monkeypatch, tmp_path)
    out = capsys.readouterr().out
    assert names == ["ours", "flash", "cudnn", "fa4"]
    assert "flash-attn-4 4.0.0b36" in out.splitlines()[0]  # the header line
    assert {"fa4_fwd", "fa4_fwdbwd", "err_fa4"} <= set(rows[0]) and rows[0]["fa4_version"] == "4.0.0b36"
    assert rows[0]["fa4_fwd"] == pytest.approx(1000) and rows[0]["fa4_fwdbwd"] == pytest.approx(1750)
    head = next(line for line in out.splitlines() if line.startswith("| hdim"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert cols[4:] == ["ours fwd", "flash fwd", "cudnn fwd", "fa4 fwd", "ours/flash", "ours/cudnn", "ours/fa4",
                        "ours f+b", "flash f+b", "cudnn f+b", "fa4 f+b", "ours/flash f+b", "ours/cudnn f+b",
                        "ours/fa4 f+b", "max err (flash err, fa4 err)"]
    row = next(line for line in out.splitlines() if line.startswith("| 128"))
    assert row.split("|")[8].strip() == "1000" and row.split("|")[11].strip() == "1.00"  # fa4 fwd, ours/fa4


@pytest.mark.parametrize("how", ["not importable", "--no-fa4"])
def test_sweep_without_fa4_runs_as_before(how, fake_fa4, monkeypatch, tmp_path, capsys):
    if how == "not importable":
        monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    names, rows = run_main(monkeypatch, tmp_path, *(["--no-fa4"] if how == "--no-fa4" else []))
    out = capsys.readouterr().out
    assert names == ["ours", "flash", "cudnn"]
    assert not any("fa4" in key for key in rows[0])
    assert "fa4" not in out.lower().replace("fa4 not importable", "")
    assert ("FA4 not importable (" in out) == (how == "not importable") and "Traceback" not in out
    assert "| ours/flash f+b | ours/cudnn f+b | max err (flash err) |" in out
