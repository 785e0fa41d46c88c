"""The repository's import graph, read from the source with `ast` (every import statement, also those
inside functions), so no GPU, no build and no optional dependency is needed to check the layout.

Modules are named as Python imports them ("training.engines.replicas", "kernels" for kernels/__init__.py); an edge
a -> b means a module of the walked packages names b in an import statement."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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


def files(*packages: str) -> dict[str, Path]:
    """Module name -> file, for every .py file under the given top-level folders."""
    return {module_name(p): p for pkg in packages for p in sorted((REPO / pkg).rglob("*.py"))}


def graph(*packages: str) -> dict[str, set[str]]:
    """Module -> the modules of the walked packages it imports (an imported name that is not a module,
    `from training.config import Config`, counts as its module)."""
    found = files(*packages)

    def resolve(target):
        while target and target not in found:
            target = target.rpartition(".")[0]
        return target

    return {m: {resolve(t) for t in imports(p) if resolve(t) not in ("", m)} for m, p in found.items()}


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


def upward(package: str, forbidden: set[str]) -> dict[str, list[str]]:
    """Module of `package` -> the names it imports whose top-level package is in `forbidden`."""
    offending = {m: sorted(t for t in imports(p) if t.split(".")[0] in forbidden)
                 for m, p in files(package).items()}
    return {m: t for m, t in offending.items() if t}
