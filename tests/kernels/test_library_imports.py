"""The kernels package is the library alone: no import circle among its modules, and nothing of the
measuring tools (bench/, dev/) imported. Read from the source (tests/import_graph.py), so no GPU and no
build are needed."""
from import_graph import REPO, circles, graph, upward


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_kernels_package_has_no_import_circle():
    assert circles(graph("kernels")) == []


def test_the_kernels_package_imports_no_tool():
    tools = {"bench", "dev"} | {p.stem for folder in ("bench", "dev") for p in (REPO / folder).glob("*.py")}
    assert upward("kernels", tools) == {}


def test_the_loader_imports_only_the_tune_cache_reader():
    """kernels.build (imported by every kernel call) reaches the tuning cache's reader and nothing of
    the tuner that writes it (timing, the sweep's shapes, the kernels it times)."""
    edges, reached, todo = graph("kernels"), set(), ["kernels.build"]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(edges[m])
    assert reached == {"kernels.build", "kernels.tune_cache"}
