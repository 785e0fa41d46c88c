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


def _row(hdim, causal, seqlen, **tflops):
    return {"hdim": hdim, "causal": causal, "seqlen": seqlen, **tflops}


def test_summary_counts_from_unrounded_ratios():
    """1.047 shows as 1.05 in the table but does not reach 1.05x; a failed peer (NaN) is left out."""
    rows = [_row(128, False, 512, ours_fwd=401.0, ours_fwdbwd=300.0, flash_fwd=200.0, flash_fwdbwd=150.0,
                 cudnn_fwd=380.0, cudnn_fwdbwd=310.0, fa4_fwd=383.0, fa4_fwdbwd=float("nan")),
            _row(64, True, 16384, ours_fwd=606.0, ours_fwdbwd=500.0, flash_fwd=300.0, flash_fwdbwd=250.0,
                 cudnn_fwd=500.0, cudnn_fwdbwd=400.0, fa4_fwd=576.0, fa4_fwdbwd=510.0)]
    lines = kernel_sweep.summary(rows).splitlines()
    assert lines[0] == "ours/flash fwd: 2.005-2.020x, >= 1.05x on 2 of 2 rows; flash ahead on 0"
    assert lines[3] == ("ours/cudnn f+b: 0.968-1.250x, >= 1.05x on 1 of 2 rows; cudnn ahead on 1: "
                        "128 non-causal 512 (0.968)")
    assert lines[4] == "ours/fa4 fwd: 1.047-1.052x, >= 1.05x on 1 of 2 rows; fa4 ahead on 0"
    assert lines[5] == "ours/fa4 f+b: 0.980-0.980x, >= 1.05x on 0 of 1 rows; fa4 ahead on 1: 64 causal 16384 (0.980)"
    assert len(lines) == 6


def test_summary_without_fa4_has_no_fa4_lines():
    rows = [_row(128, True, 1024, ours_fwd=1.0, ours_fwdbwd=1.0, flash_fwd=1.0, flash_fwdbwd=1.0,
                 cudnn_fwd=2.0, cudnn_fwdbwd=1.0)]
    assert [line.split(":")[0] for line in kernel_sweep.summary(rows).splitlines()] == [
        "ours/flash fwd", "ours/flash f+b", "ours/cudnn fwd", "ours/cudnn f+b"]
