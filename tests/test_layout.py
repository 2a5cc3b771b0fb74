"""The package's layout (DESIGN.md): module-level imports form no circle, and the checkpoint readers know
nothing of the kernels."""

from __future__ import annotations

import ast
from pathlib import Path

import smollm2

ROOT = Path(smollm2.__file__).parent


def modules() -> dict[str, Path]:
    """smollm2's modules by dotted name (a package by its own name, for its __init__.py)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def top_level_imports(tree: ast.Module):
    """The import statements that run when the module is imported: at its top level, or in a top-level if or try
    (not under `if TYPE_CHECKING:`); never inside a function or class."""
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            yield from top_level_imports(ast.Module(node.body + node.orelse, []))
        elif isinstance(node, ast.Try):
            yield from top_level_imports(ast.Module(node.body + node.orelse + node.finalbody
                                                    + [n for h in node.handlers for n in h.body], []))


def imported(name: str, path: Path, known: dict[str, Path], anywhere: bool = False) -> set[str]:
    """The smollm2 modules that `name` imports at module level (anywhere: inside functions too): `from .x import y`
    -> x (or x.y where y is a module), `from . import y` -> y where y is a module, else the package itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree, found = ast.parse(path.read_text()), set()
    statements = ([n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] if anywhere
                  else top_level_imports(tree))
    for node in statements:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
            continue
        base = node.module or ""
        if node.level:
            parent = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join(parent + ([node.module] if node.module else []))
        found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    return found & known.keys()


def test_module_level_imports_form_no_circle():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert graph["smollm2.kernels.accelerate"] >= {"smollm2.model", "smollm2.kernels.ops"}  # the parser sees them
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(name):] + [name]))
        if name not in done:
            path.append(name)
            for other in sorted(graph[name]):
                visit(other)
            path.pop()
            done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_checkpoint_readers_know_no_kernel():
    known = modules()
    for name, path in known.items():
        if name.startswith("smollm2.checkpoints"):
            kernel_imports = {m for m in imported(name, path, known, anywhere=True)
                              if m.split(".")[:2] == ["smollm2", "kernels"]}
            assert not kernel_imports, f"{name} imports {kernel_imports}"
