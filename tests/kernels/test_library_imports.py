"""The kernels package is the library alone: no import circle among its modules, and nothing of the
measuring tools (bench/, dev/) imported. Read from the source (every import statement, also those
inside functions), so no GPU and no build are needed."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kernels"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Absolute names each import statement of the file names (`from . import x` -> 'pkg.x')."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(target):
        while target and target not in files:
            target = target.rpartition(".")[0]
        return target

    return {m: {resolve(t) for t in imports(p) if resolve(t) not in ("", m)} for m, p in files.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_kernels_package_has_no_import_circle():
    assert circles(graph()) == []


def test_the_kernels_package_imports_no_tool():
    tools = {"bench", "dev"} | {p.stem for folder in ("bench", "dev") for p in (REPO / folder).glob("*.py")}
    offending = {module_name(p): sorted(t for t in imports(p) if t.split(".")[0] in tools)
                 for p in PACKAGE.rglob("*.py")}
    assert {m: t for m, t in offending.items() if t} == {}


def test_the_loader_imports_only_the_tune_cache_reader():
    """kernels.build (imported by every kernel call) reaches the tuning cache's reader and nothing of
    the tuner that writes it (timing, the sweep's shapes, the kernels it times)."""
    edges, reached, todo = graph(), set(), ["kernels.build"]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(edges[m])
    assert reached == {"kernels.build", "kernels.tune_cache"}
