"""The package's layout (DESIGN.md): imports only go down its floors, counting imports inside functions and under
TYPE_CHECKING; they form no circle; the checkpoint readers know nothing of the kernels; model.py stays short."""

from __future__ import annotations

import ast
from pathlib import Path

import smollm2

ROOT = Path(smollm2.__file__).parent

# DESIGN.md's floors: each module's by its dotted name, or by the package it is in (the innermost one listed). A
# module imports from its own floor or the ones below, never from one above; a new module needs a line here.
FLOORS = {
    # 1: the reference architecture, read top to bottom, and what it is made of
    "smollm2.model": 1, "smollm2.kv_cache": 1, "smollm2.config": 1, "smollm2.errors": 1,
    # 2: what a model is read from and written to, and made fast with; module swaps; a JSON schema's bounds
    "smollm2.checkpoints": 2, "smollm2.kernels": 2, "smollm2.quantize": 2, "smollm2.lora": 2,
    "smollm2.json_schema": 2,
    # 3: loading a model, driving it (generation), reading inside it (lens, patching, SAEs), text and tool calls
    "smollm2.loading": 3, "smollm2.generation": 3, "smollm2.lens": 3, "smollm2.patching": 3, "smollm2.sae": 3,
    "smollm2.generation.request": 3,  # the one Request: every API's body and generate() make one
    "smollm2.features": 3, "smollm2.graphs": 3,
    "smollm2.tokenizer": 3, "smollm2.tools": 3,
    # 4: what is built on them: the server, training, speed and quality measured
    "smollm2.server": 4, "smollm2.training": 4, "smollm2.bench": 4, "smollm2.evaluate": 4, "smollm2.harness": 4,
    # 5: the command line, and the package's own __init__, which names what every floor offers (floor 3's lazily)
    "smollm2.cli": 5, "smollm2.__main__": 5, "smollm2": 5,
}


def modules() -> dict[str, Path]:
    """smollm2's modules by dotted name (a package by its own name, for its __init__.py)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The smollm2 modules that `name` imports, anywhere in it (in functions too, and under TYPE_CHECKING):
    `from .x import y` -> x (or x.y where y is a module), `from . import y` -> y where y is a module, else the
    package itself. Importing a.b.c runs the package a.b first: it counts too, unless `name` is inside it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    packages = {".".join(m.split(".")[:i]) for m in found for i in range(1, m.count(".") + 1)}
    return (found | {p for p in packages if not (name == p or name.startswith(p + "."))}) & known.keys()


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) - {name} for name, path in known.items()}


def floor(name: str) -> int:
    """FLOORS' entry for the module, or for the innermost package holding it (the top package counts only as
    itself: every module is inside it)."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        if ".".join(parts[:i]) in FLOORS:
            return FLOORS[".".join(parts[:i])]
    if name in FLOORS:
        return FLOORS[name]
    raise AssertionError(f"{name} has no floor: give it one in FLOORS (tests/test_layout.py), as DESIGN.md says")


def test_imports_form_no_circle():
    graph = import_graph()
    assert graph["smollm2.kernels.accelerate"] >= {"smollm2.model", "smollm2.kernels.ops"}  # the parser sees them
    assert "smollm2.loading" in graph["smollm2"]  # and the imports inside functions
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


def test_imports_only_go_down_the_floors():
    graph = import_graph()
    floors = {name: floor(name) for name in graph}  # every module has one
    upward = [f"{name} (floor {floors[name]}) imports {other} (floor {floors[other]})"
              for name, others in sorted(graph.items()) for other in sorted(others) if floors[other] > floors[name]]
    assert not upward, "\n".join(upward)


def test_model_py_stays_short():
    """The reference architecture, read top to bottom in one sitting (README: ~260 lines)."""
    assert len((ROOT / "model.py").read_text().splitlines()) <= 260


def test_the_checkpoint_readers_know_no_kernel():
    known = modules()
    for name, path in known.items():
        if name.startswith("smollm2.checkpoints"):
            kernel_imports = {m for m in imported(name, path, known)
                              if m.split(".")[:2] == ["smollm2", "kernels"]}
            assert not kernel_imports, f"{name} imports {kernel_imports}"
