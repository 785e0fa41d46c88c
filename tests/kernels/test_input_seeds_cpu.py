"""gpu_util.InputSeeds on the CPU: a test's seeds depend on its id only, not on the tests before it."""
from __future__ import annotations

from gpu_util import InputSeeds


def test_same_test_same_seeds_whatever_ran_before():
    seeds = InputSeeds(100)
    InputSeeds.start_test("tests/x.py::test_a[1]")
    first = [next(seeds), next(seeds)]
    InputSeeds.start_test("tests/x.py::test_b")
    next(seeds)
    InputSeeds.start_test("tests/x.py::test_a[1]")
    assert [next(seeds), next(seeds)] == first
    assert first[1] == first[0] + 1


def test_tests_and_modules_differ():
    a, b = InputSeeds(100), InputSeeds(5000)
    InputSeeds.start_test("tests/x.py::test_a[1]")
    sa, sb = next(a), next(b)
    assert sb - sa == 4900
    InputSeeds.start_test("tests/x.py::test_a[2]")
    assert next(a) != sa
