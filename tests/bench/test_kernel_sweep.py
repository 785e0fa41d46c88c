"""bench/kernel_sweep.py's --compare-* variants: each writes its choices into the row's entries of the
Hopper dispatch table for the call and puts back what was there (a tuning cache's choice included)."""
import pytest

import kernel_sweep


class FakeExt:
    """The dispatch-table part of the extension's binding: entries (pass, head dim, causal, bucket)."""

    def __init__(self):
        self.table = {}

    def seqlen_bucket(self, n):
        return 0 if n <= 1024 else 1 if n <= 2048 else 2 if n <= 4096 else 3

    def sm90_choice(self, p, d, causal, bucket):
        return self.table.get((p, d, causal, bucket), -1)

    def set_sm90_choice(self, p, d, causal, bucket, choice):
        self.table[(p, d, causal, bucket)] = choice


@pytest.fixture
def fake_ext(monkeypatch):
    import kernels.build

    ext = FakeExt()
    monkeypatch.setattr(kernels.build, "load_extension", lambda *a, **kw: ext)
    return ext


def test_variants_are_table_choices():
    assert set(kernel_sweep.VARIANTS) == {"fa2", "fa2bwd", "bwdlockstep", "bwdpingpong"}
    assert kernel_sweep.VARIANTS["bwdlockstep"][0] == {1: 2} and kernel_sweep.VARIANTS["bwdpingpong"][0] == {1: 3}


def test_variant_sets_the_rows_class_and_puts_it_back(fake_ext):
    fake_ext.table[(1, 128, True, 1)] = 3  # a tuning cache's choice
    with kernel_sweep.variant("fa2", 128, True, 2048):
        assert fake_ext.table == {(0, 128, True, 1): 0, (1, 128, True, 1): 0}
    assert fake_ext.table == {(0, 128, True, 1): -1, (1, 128, True, 1): 3}
    with pytest.raises(RuntimeError):
        with kernel_sweep.variant("bwdlockstep", 64, False, 512):
            assert fake_ext.table[(1, 64, False, 0)] == 2
            raise RuntimeError("a backend refused the shape")
    assert fake_ext.table[(1, 64, False, 0)] == -1


def test_default_and_other_head_dims_touch_nothing(fake_ext):
    with kernel_sweep.variant(None, 128, True, 2048), kernel_sweep.variant("fa2", 96, True, 2048):
        assert fake_ext.table == {}
