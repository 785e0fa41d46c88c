"""The packages' layout, read from the source (tests/import_graph.py): no import circle among the
modules of model/, kernels/, training/, data/ and launch/, and each package imports only the layers
below it: launch -> training -> data, model -> kernels. A circle or an upward import makes a module
importable only in one order, and ties a library (data, model, kernels) to the trainer or the tools."""
import pytest

from import_graph import circles, graph, upward

PACKAGES = ("model", "kernels", "training", "data", "launch")


def test_no_import_circle():
    found = circles(graph(*PACKAGES))
    assert found == [], "import circles (each a group of modules that import each other): " + \
        "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("package, above", [
    ("training", {"launch", "bench", "dev"}),
    ("data", {"training", "launch", "bench", "dev"}),
    ("model", {"training", "launch", "bench", "dev"}),
    ("kernels", {"training", "launch", "bench", "dev"}),
])
def test_no_upward_import(package, above):
    assert upward(package, above) == {}, f"{package}/ imports from {sorted(above)}"
