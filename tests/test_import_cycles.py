"""No module of the package imports one that imports it back, at any level: imports inside
functions count too (a lazy import only moves the circle to run time)."""

import ast
import pathlib

import vllm_tpu_lora

PACKAGE_DIR = pathlib.Path(vllm_tpu_lora.__file__).parent
PACKAGE = PACKAGE_DIR.name


def _module_names() -> dict[str, pathlib.Path]:
    names = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join([PACKAGE, *parts])] = path
    return names


def _imports(module: str, path: pathlib.Path, modules: dict) -> dict[str, int]:
    """Package modules `module` imports -> the line of the first such import."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        # `import a.b.c` binds through a.b.c; keep the longest prefix that is a module.
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if not name:
            return  # not a module of the package
        # Importing a.b.c first runs the __init__ of each package above it, unless that
        # package is one the importer lives in (it is already initialising).
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            target = ".".join(parts[:i])
            if target != module and not module.startswith(target + "."):
                found.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in modules else source, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    modules = _module_names()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle as [m0, m1, ..., m0], or None (iterative DFS, three colours)."""
    state: dict[str, int] = {}
    for root in sorted(graph):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph[child]))))
    return None


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return "\n".join(f"  {a} (line {graph[a][b]}) imports {b}" for a, b in zip(cycle, cycle[1:]))


def test_package_has_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle:\n" + _describe(cycle, graph)


def test_checker_finds_a_planted_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None
