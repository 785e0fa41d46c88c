import os

import pytest

from training.allocator import expandable_segments_by_default


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_expandable_segments_set_when_nothing_is(clean_env):
    expandable_segments_by_default()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.parametrize("key", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_a_users_allocator_setting_wins(clean_env, key):
    clean_env.setenv(key, "max_split_size_mb:512")
    expandable_segments_by_default()
    assert os.environ[key] == "max_split_size_mb:512"
    other = {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} - {key}
    assert all(k not in os.environ for k in other)
