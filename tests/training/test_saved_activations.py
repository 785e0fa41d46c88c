"""bench/saved_activations.py: the saved_tensors_hook sees what the compiled training forward keeps."""
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import saved_activations  # noqa: E402

from model.config import GPTConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402


def test_compiled_forward_saves_each_layers_qkv_once():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=2, vocab_size=128, seq_len=32, attention="sdpa")
    batch = 2
    saved = saved_activations.saved_for_backward(GPT(cfg), batch, budget=1.0, device="cpu")
    storages = {s[3]: s[2] for s in saved}
    tokens = batch * cfg.seq_len
    qkv_bytes = tokens * 3 * cfg.d_model * 2  # the bf16 q/k/v projection output, one storage per layer
    assert sum(1 for b in storages.values() if b == qkv_bytes) == cfg.n_layer
    units = sum(storages.values()) / (2 * cfg.d_model * tokens * cfg.n_layer)
    assert 10 < units < 30, units  # 18 per block (bench/RESULTS.md, end to end) + the head's share
