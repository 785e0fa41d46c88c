"""Bad data through the real entry point: one `data error:` line on stderr naming the file (and the
line), exit code 2, no traceback (launch/train.py); README "Errors and what to do"."""
import json
import subprocess
import sys

from data.prepare import prepare
from training.config import load_config

import fault_trials as ft  # bench/fault_trials.py (conftest puts bench/ on the path)

sys.path.insert(0, str(ft.REPO / "tests" / "data"))
from data_helpers import random_docs, write_jsonl  # noqa: E402


def launch(tmp_path, *overrides):
    cmd = [sys.executable, ft.TRAIN, "--config", "tiny_cpu.yaml", f"train.out_dir={tmp_path / 'runs'}",
           f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=2", *ft.FAST, *overrides]
    return subprocess.run(cmd, cwd=ft.REPO, env=ft.environment(), capture_output=True, text=True,
                          timeout=ft.TIMEOUT)


def one_data_error(proc, *words):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if "error" in x.lower()]
    assert len(errors) == 1 and errors[0].startswith("data error: "), proc.stderr[-3000:]
    for w in words:
        assert w in errors[0], errors[0]


def test_non_utf8_line_given_without_brackets(tmp_path):
    src = tmp_path / "latin1.jsonl"
    rows = [json.dumps({"text": d}).encode() for d in random_docs(20, seed=1)]
    rows[6] = '{"text": "Erwin Schrödinger"}'.encode("latin-1")
    src.write_bytes(b"\n".join(rows) + b"\n")
    one_data_error(launch(tmp_path, f"data.source={src}"), str(src), "not UTF-8", "(line 7)", "iconv")


def test_file_that_is_not_parquet(tmp_path):
    (tmp_path / "src").mkdir()
    write_jsonl(tmp_path / "src" / "a.jsonl", random_docs(20, seed=2))
    (tmp_path / "src" / "b.parquet").write_bytes(bytes(range(256)) * 8)
    one_data_error(launch(tmp_path, f"data.source=[{tmp_path / 'src'}]"), "b.parquet is not a parquet file")


def test_empty_jsonl(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    one_data_error(launch(tmp_path, f"data.source={tmp_path / 'empty.jsonl'}"), "empty.jsonl is empty (0 bytes)")


def test_cached_shards_beyond_the_model_vocab(tmp_path):
    """A reused cache whose meta.json records ids the model has no embedding rows for."""
    src = write_jsonl(tmp_path / "docs.jsonl", random_docs(40, seed=3))
    overrides = [f"data.source={src}", f"data.cache_dir={tmp_path / 'cache'}", "data.tokenizer_vocab_size=300"]
    p = prepare(load_config("tiny_cpu.yaml", overrides).data, 4096)
    meta = json.loads((p.dir / "meta.json").read_text())
    (p.dir / "meta.json").write_text(json.dumps({**meta, "max_token_id": 5000}))
    one_data_error(launch(tmp_path, *overrides), str(p.dir), "max token id 5000", "model.vocab_size=4096",
                   f"delete {p.dir}")
