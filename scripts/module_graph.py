"""The import graph of the ``layerswap`` package: modules, their imports, cycles, private reaches.

Reads every module's source (nothing is imported). An edge is any ``import`` of a
``layerswap`` module, at the top or inside a function (a function-local import that
hides a cycle is still a cycle); imports under ``if TYPE_CHECKING:`` are left out, as
they never run, and counted apart: a cycle through them is a cycle too (types that name
each other belong in one module). Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` too, so
those edges count, except to the importer's own packages (they ran before it). Lazy imports of third-party packages are not edges.

Prints, per module: its lines and the layerswap modules it imports; then every import
cycle, and every import of an underscore name (or module) from outside its folder (a
folder's private modules are its subfolders' too: each backend's package uses the
backends' ``_layer``). A module
may also name another by string, to be imported when called: ``Lazy("layerswap.x:f")``
(a backend declaration's layers), ``import_module("layerswap.x")``, ``resolve(...)``.
Those targets are counted and listed apart (they run at call time, not import time, so
they make no import cycle), and each must exist: a missing module or function is an error.
A package below another module (:data:`BELOW`: the families and the backends below the
registry) must not reach it through any chain of imports.

    python scripts/module_graph.py            # the listing
    python scripts/module_graph.py --check    # exit 1 on a cycle, a private reach, a
                                              # missing named target, a layer reached or
                                              # a module or function over its size
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "layerswap"
PACKAGE = "layerswap"


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> source file, for every module of the package."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in (
        "TYPE_CHECKING",
        "typing.TYPE_CHECKING",
    )


def _imports(tree: ast.AST, *, typed: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth, outside TYPE_CHECKING blocks
    (``typed``: those inside them too)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if _type_checking(child) and not typed:
                stack.extend(child.orelse)  # type: ignore[attr-defined]
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _with_parents(name: str, known: dict[str, Path]) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in known]


def graph(
    known: dict[str, Path] | None = None, *, typed: bool = False
) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """(module -> the modules it imports, [(importer, imported module, private name)]);
    ``typed``: the imports for type checkers counted too."""
    known = modules() if known is None else known
    edges: dict[str, set[str]] = {name: set() for name in known}
    private: list[tuple[str, str, str]] = []
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_package = path.name == "__init__.py"
        for node in _imports(tree, typed=typed):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
                names: list[tuple[str, str]] = []
            else:
                source = _absolute(module, node, is_package)
                targets = [source]
                names = [(source, alias.name) for alias in node.names]
                # `from pkg import submodule` imports the submodule
                targets += [f"{source}.{alias.name}" for alias in node.names]
            for target in targets:
                if target.split(".")[0] != PACKAGE:
                    continue
                if (
                    target in known
                    and _private_module(target)
                    and not _within(module, target, known)
                ):
                    private.append((module, target.rpartition(".")[0], target.rpartition(".")[2]))
                for imported in _with_parents(target, known):
                    # a module's own packages have run before it: no edge back to them
                    if imported != module and not module.startswith(imported + "."):
                        edges[module].add(imported)
            for source, name in names:
                if source.split(".")[0] != PACKAGE or f"{source}.{name}" in known:
                    continue
                underscore = name.startswith("_") and not name.startswith("__")
                if underscore and not _within(module, source, known):
                    private.append((module, source, name))
    return edges, private


def _typed_edges(known: dict[str, Path], edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The edges with the imports for type checkers added, but for a package's own face:
    a package naming its submodules' exports for type checkers (the PEP 562 lazy exports
    of ``layerswap/__init__`` and ``layerswap/verify/__init__``) is no dependency of them."""
    typed, _ = graph(known, typed=True)
    return {
        module: {
            target
            for target in targets
            if target in edges[module]
            or not (known[module].name == "__init__.py" and target.startswith(module + "."))
        }
        for module, targets in typed.items()
    }


#: calls whose first argument names a module (and maybe a function in it) to import later
_NAMING_CALLS = ("Lazy", "import_module", "resolve")


def named_targets(known: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """module -> the ``"layerswap.mod[:name]"`` targets it names in :data:`_NAMING_CALLS`."""
    known = modules() if known is None else known
    found: dict[str, set[str]] = {name: set() for name in known}
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            first = node.args[0]
            if (
                called in _NAMING_CALLS
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and first.value.split(".")[0] == PACKAGE
            ):
                found[module].add(first.value)
    return found


def unresolved(targets: dict[str, set[str]], known: dict[str, Path]) -> list[tuple[str, str]]:
    """(namer, target) for each target whose module or top-level name does not exist."""
    missing = []
    for namer, named in targets.items():
        for target in sorted(named):
            module, _, name = target.partition(":")
            if module not in known:
                missing.append((namer, target))
                continue
            if name and name.split(".")[0] not in _top_level_names(known[module]):
                missing.append((namer, target))
    return missing


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _private_module(name: str) -> bool:
    last = name.rpartition(".")[2]
    return last.startswith("_") and not last.startswith("__")


def _within(module: str, owner: str, known: dict[str, Path]) -> bool:
    """Whether ``module`` sits in ``owner``'s folder or below it."""
    return _folder(owner, known) in (_folder(module, known), *_folder(module, known).parents)


def _folder(module: str, known: dict[str, Path]) -> Path:
    return known[module].parent if module in known else Path()


#: packages below a module: nothing they import reaches it, directly or through another
#: module (the families are declarations and what inference reads off transformers, the
#: backends' modules their declarations and layers; the registry holds and derives from
#: them, and is given to them where they need it)
BELOW = {"layerswap.families": "layerswap.registry", "layerswap.backends": "layerswap.registry"}


def layering(edges: dict[str, set[str]]) -> list[tuple[str, list[str]]]:
    """Every module of a :data:`BELOW` package that reaches the module it sits below, with
    the path of imports that does."""
    found = []
    for package, above in BELOW.items():
        for module in sorted(edges):
            if module != package and not module.startswith(package + "."):
                continue
            path = _path(edges, module, above)
            if path is not None:
                found.append((module, path))
    return found


def _path(edges: dict[str, set[str]], start: str, target: str) -> list[str] | None:
    """A chain of imports from ``start`` to ``target`` (breadth first), or ``None``."""
    came_from: dict[str, str | None] = {start: None}
    queue = [start]
    for node in queue:
        if node == target:
            path: list[str] = []
            step: str | None = node
            while step is not None:
                path.append(step)
                step = came_from[step]
            return path[::-1]
        for imported in sorted(edges.get(node, ())):
            if imported not in came_from:
                came_from[imported] = node
                queue.append(imported)
    return None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


#: the most lines a hand-written module may have, and a function
MODULE_LINES, FUNCTION_LINES = 600, 80
#: what a generated module's docstring says of it (its size is its data's)
GENERATED = "(generated: do not edit)"


def oversized(known: dict[str, Path]) -> list[str]:
    """Every hand-written module over :data:`MODULE_LINES` lines and every function over
    :data:`FUNCTION_LINES`, as ``"module (N lines)"`` / ``"module.function (N lines)"``."""
    found = []
    for module, path in sorted(known.items()):
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        if GENERATED in (ast.get_docstring(tree) or "").partition("\n")[0]:
            continue
        lines = len(source.splitlines())
        if lines > MODULE_LINES:
            found.append(f"{module} ({lines} lines)")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > FUNCTION_LINES:
                    found.append(f"{module}.{node.name} ({length} lines)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 on a cycle (imports for type checkers included), a private reach, a "
        "named target that does not exist, a package reaching what it sits below, or a "
        "module or function over its size",
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="the package folder to read")
    args = parser.parse_args(argv)
    known = modules(args.root)
    edges, private = graph(known)
    targets = named_targets(known)
    for module in sorted(known):
        lines = len(known[module].read_text(encoding="utf-8").splitlines())
        imported = ", ".join(sorted(edges[module])) or "-"
        later = ", ".join(sorted(targets[module]))
        print(f"{module} ({lines} lines) -> {imported}" + (f"; names {later}" if later else ""))
    found = cycles(edges)
    typed = [c for c in cycles(_typed_edges(known, edges)) if c not in found]
    missing = unresolved(targets, known)
    named = sum(map(len, targets.values()))
    print(f"\n{len(known)} modules, {sum(map(len, edges.values()))} imports, {named} named")
    print(f"cycles: {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))
    print(f"cycles through imports for type checkers: {len(typed)}")
    for component in typed:
        print("  " + " <-> ".join(component))
    print(f"underscore names imported from outside their folder: {len(private)}")
    for importer, source, name in private:
        print(f"  {importer} imports {source}.{name}")
    print(f"named targets that do not exist: {len(missing)}")
    for namer, target in missing:
        print(f"  {namer} names {target}")
    reaching = layering(edges)
    print(f"modules reaching what they sit below: {len(reaching)}")
    for _module, path in reaching:
        print("  " + " -> ".join(path))
    large = oversized(known)
    print(
        f"modules over {MODULE_LINES} lines or functions over {FUNCTION_LINES}, "
        f"generated ones aside: {len(large)}"
    )
    for name in large:
        print(f"  {name}")
    failed = found or typed or private or missing or reaching or large
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
