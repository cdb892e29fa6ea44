#!/usr/bin/env python3
# The layering check of the source tree: import loops among python/cring
# modules and includes of another C layer's internal headers. Reads files
# only (ast, text); imports nothing of cring and builds nothing.
"""Check that imports in python/cring and includes in csrc/ go one way.

Usage: python scripts/check_layers.py [--root DIR] [--graph]
Exit status 0 when both checks pass, 1 with a list of the problems.

Python: no import loops
-----------------------
The graph has one node per module under python/cring (a package is its
__init__.py) and one edge per import of another cring module, found with the
ast module wherever the import statement is:

* ``import cring.a.b`` and ``from cring.a import b`` (or ``from .a import b``)
  give an edge to ``cring.a.b`` when that is a module, else to ``cring.a``;
  ``import cring`` gives an edge to the package ``cring``. Parent packages that
  Python imports along the way are not edges (they are always on the way in).
* An import at module level (also inside ``if``/``try`` blocks) is a
  *module-level* edge. An import inside a function or method body is a
  *function-level* edge. Imports under ``if TYPE_CHECKING:`` are never run and
  are not edges. Modules outside cring and the C extension ``cring._C``
  (EXTENSIONS) are not nodes.

Rule: the graph of *all* edges, module-level and function-level, has no
cycle. A cycle of module-level edges only is an import loop (the second
module sees the first one half-initialised); a cycle that needs a
function-level edge is the same loop postponed to the first call, so it is an
error too (lightning's _common -> _environment deferred import was one). The
two kinds are listed separately so that the deferred ones are easy to spot.
The fix is a module lower down that both sides import.

C: no includes of another layer's internal headers
--------------------------------------------------
A *layer* is a directory directly under csrc/ (csrc/include holds the public
API, cring/cring.h, which any file may include). Layers from the bottom up,
as in DESIGN.md (gpu sits below the engine, which drives it)::

    common < bootstrap < transport < reduce < algo < core < gpu < engine < pyext

Rules for a C file (``.c`` or ``.h``) in layer L including header H of layer M:

1. M == L: always allowed (a layer sees all of itself).
2. M above L: error (layers call only downwards).
3. M below L: H must be on M's *face* (the table FACES below) and L in that
   entry's audience. Every header of a layer that is not on its face is
   internal to it: ``*_internal.h``, ``*_impl.h``, engine/strmap.h,
   gpu/cuda_api.h, the store's protocol header, ...

The faces, from DESIGN.md's layer list and the headers' own opening comments:
common exports its utilities (common.h, net.h, auth.h, wire.h, result_cache.h)
to everyone;
bootstrap nothing (its API is cring.h); transport its ops table (transport.h);
reduce its kernels (reduce.h) to the layers that compute (algo, core, gpu,
engine), not to the Python binding; algo algo.h and agree.h; core
comm_internal.h to the engine only (its header says so); gpu gpu.h; engine
and pyext nothing (the engine's face is cring.h). The binding layer (pyext)
thus sees cring.h, common's utilities and gpu.h. Adding a face is a
deliberate one-line change to FACES.

Includes are resolved relative to the including file, then csrc/, then
csrc/include/ (the compiler's -I order); ``<...>`` includes are ignored.
Files under csrc/tests may include anything (tests reach into layers).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "cring"
# Compiled extension modules of the package: not nodes (they import nothing of it).
EXTENSIONS = frozenset({"cring._C"})

LAYERS = ("common", "bootstrap", "transport", "reduce", "algo", "core", "gpu", "engine", "pyext")
# Directories under csrc/ that are not layers: the public API and the tests.
PUBLIC_DIR = "include"
EXEMPT_DIRS = ("tests",)

_ALL = frozenset(LAYERS)
# layer -> {header file name: the layers that may include it}
FACES: dict[str, dict[str, frozenset[str]]] = {
    "common": {name: _ALL for name in ("common.h", "net.h", "auth.h", "wire.h", "result_cache.h")},
    "bootstrap": {},
    "transport": {"transport.h": _ALL},
    "reduce": {"reduce.h": frozenset({"algo", "core", "gpu", "engine"})},
    "algo": {"algo.h": _ALL, "agree.h": _ALL},
    "core": {"comm_internal.h": frozenset({"engine"})},
    "gpu": {"gpu.h": _ALL},
    "engine": {},
    "pyext": {},
}


# ---------------------------------------------------------------------------
# Python
# ---------------------------------------------------------------------------


def python_modules(package_dir: Path) -> dict[str, Path]:
    """{dotted module name: file} for every .py file of the package."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[ast.stmt, bool]]:
    """(import statement, inside a function) for every import that can run."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, in_function = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, in_function) for child in node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
            continue
        nested = in_function or isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        )
        stack.extend((child, nested) for child in ast.iter_child_nodes(node))


def _resolve(module: str, is_package: bool, node: ast.stmt, known: set[str]) -> list[str]:
    """The cring modules an import statement in `module` brings in."""
    targets = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in known:  # 'import cring.x.y' of a non-module y
                name = name.rpartition(".")[0]
            if name:
                targets.append(name)
        return targets
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    if source != PACKAGE and not source.startswith(PACKAGE + "."):
        return targets
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        if submodule in EXTENSIONS:
            continue
        if submodule in known:
            targets.append(submodule)
        elif source in known:
            targets.append(source)
    return targets


def import_graph(package_dir: Path) -> dict[str, dict[str, list[str]]]:
    """{module: {imported module: ["module" | "function", ...] per statement}}."""
    modules = python_modules(package_dir)
    known = set(modules)
    graph: dict[str, dict[str, list[str]]] = {name: {} for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, in_function in _imports(tree):
            for target in _resolve(name, is_package, node, known):
                if target != name:
                    kind = "function" if in_function else "module"
                    graph[name].setdefault(target, []).append(kind)
    return graph


def _loops(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # recursive: the graph is small
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strongconnect(w)
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
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return components


def check_python(root: Path) -> list[str]:
    graph = import_graph(root / "python" / PACKAGE)
    module_level = {
        m: {t for t, kinds in ts.items() if "module" in kinds} for m, ts in graph.items()
    }
    every = {m: set(ts) for m, ts in graph.items()}
    problems = []

    def describe(component: list[str], edges: dict[str, set[str]]) -> str:
        members = set(component)
        steps = []
        for a in component:
            for b in sorted(edges[a] & members):
                deferred = "module" not in graph[a][b]
                steps.append(f"{a} -> {b}{' (in a function)' if deferred else ''}")
        return f"{', '.join(component)}: " + "; ".join(steps)

    loops = _loops(module_level)
    for component in loops:
        problems.append("import loop (module level) among " + describe(component, module_level))
    for component in _loops(every):
        if component not in loops:
            problems.append(
                "import loop through a function-level import among " + describe(component, every)
            )
    return problems


# ---------------------------------------------------------------------------
# C
# ---------------------------------------------------------------------------

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _layer_of(path: Path, csrc: Path) -> str:
    return path.relative_to(csrc).parts[0]


def _resolve_include(name: str, including: Path, csrc: Path) -> Path | None:
    for base in (including.parent, csrc, csrc / PUBLIC_DIR):
        candidate = (base / name).resolve()
        if candidate.is_file():
            return candidate
    return None


def check_c(root: Path) -> list[str]:
    csrc = (root / "csrc").resolve()
    problems = []
    files = sorted(p for p in csrc.rglob("*") if p.suffix in (".c", ".h") and p.is_file())
    for path in files:
        layer = _layer_of(path, csrc)
        if layer in EXEMPT_DIRS or layer == PUBLIC_DIR:
            continue
        where = path.relative_to(root)
        if layer not in FACES:
            problems.append(f"{where}: csrc/{layer} is not a known layer (add it to LAYERS/FACES)")
            continue
        for name in _INCLUDE.findall(path.read_text(encoding="utf-8", errors="replace")):
            target = _resolve_include(name, path, csrc)
            if target is None:
                problems.append(f'{where}: #include "{name}" not found')
                continue
            try:
                target_layer = _layer_of(target, csrc)
            except ValueError:  # outside csrc/
                problems.append(f'{where}: #include "{name}" is outside csrc/')
                continue
            if target_layer in (layer, PUBLIC_DIR):
                continue
            shown = target.relative_to(csrc)
            if target_layer in EXEMPT_DIRS or target_layer not in FACES:
                problems.append(f"{where}: includes {shown}, which is not a layer's header")
            elif LAYERS.index(target_layer) > LAYERS.index(layer):
                problems.append(
                    f"{where}: includes {shown} from the {target_layer} layer, above {layer}"
                )
            else:
                audience = FACES[target_layer].get(target.name)
                if audience is None:
                    problems.append(
                        f"{where}: includes {shown}, internal to the {target_layer} layer"
                    )
                elif layer not in audience:
                    allowed = ", ".join(sorted(audience))
                    problems.append(
                        f"{where}: includes {shown}, which {target_layer} offers only to {allowed}"
                    )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument(
        "--graph", action="store_true", help="print the Python import graph and exit"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.graph:
        for module, targets in import_graph(root / "python" / PACKAGE).items():
            for target, kinds in sorted(targets.items()):
                print(f"{module} -> {target} ({', '.join(sorted(set(kinds)))})")
        return 0
    python_problems = check_python(root)
    c_problems = check_c(root)
    for title, problems in (
        ("Python import loops", python_problems),
        ("C includes across layers", c_problems),
    ):
        if problems:
            print(f"{title}: {len(problems)} problem(s)")
            for problem in problems:
                print(f"  {problem}")
    if python_problems or c_problems:
        return 1
    print("layers: no import loops in python/cring, no cross-layer internal includes in csrc/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
