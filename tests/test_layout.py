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
    # 4: what is built on them: the server, training, speed (whole, and a pass's roofline) and quality measured
    "smollm2.server": 4, "smollm2.training": 4, "smollm2.bench": 4, "smollm2.roofline": 4, "smollm2.evaluate": 4,
    "smollm2.harness": 4,
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


def test_the_lens_knows_no_kernel():
    """Seeing inside reads model.py's own math; what the kernels make of it is speed, which the roofline profiler
    (floor 4, beside bench) measures."""
    known = modules()
    kernel_imports = {m for m in imported("smollm2.lens", known["smollm2.lens"], known)
                      if m.split(".")[:2] == ["smollm2", "kernels"]}
    assert not kernel_imports, f"smollm2.lens imports {kernel_imports}"


# cli.py holds no recipe: each command turns its flags into the library's values, makes the one call that does its
# work, and prints what comes back. A recipe is library calls strung together (load this, build that from it, check
# it against the other, then train): a Python user would have to repeat it to get what the command gets, so it
# belongs in a library function the command calls. What a command may call beside its one call:
# - the loaders of what its flags name, as a Python user's first lines are (smollm2.load, Tokenizer.from_pretrained,
#   a draft for --speculative, an app over the sources `serve` names),
# - classes: a value built from flags (Sampling, TrainConfig, bench.Setup, a PrefixCache) is an argument, not a step,
# - whatever it prints (a table, a count read back),
# and, the one call made, nothing of a model's: what its shape implies (a window, a vocabulary) is the library's.
def cli_loaders() -> set:
    from smollm2 import loading
    from smollm2.generation.speculative import speculation
    from smollm2.server import load_app
    from smollm2.tokenizer import Tokenizer

    return {loading.load, Tokenizer.from_pretrained, speculation, load_app}


def library_calls(tree: ast.Module) -> dict[str, list[str]]:
    """Each command's calls into smollm2 (the functions the parser runs, with the cli.py functions they call or
    hand on), loaders, classes and printing aside; along an if, the branch with more."""
    import importlib

    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    commands = [keyword.value.id for node in ast.walk(tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute) and node.func.attr == "set_defaults"
                for keyword in node.keywords if keyword.arg == "run"]

    def bindings(scope: ast.AST) -> dict[str, object]:
        """The smollm2 names an import in scope binds: local name -> object."""
        bound = {}
        for node in ast.walk(scope):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                module = importlib.import_module("smollm2" + (f".{node.module}" if node.module else ""))
                for alias in node.names:  # a name the module holds, else its submodule
                    bound[alias.asname or alias.name] = getattr(module, alias.name) if hasattr(module, alias.name) \
                        else importlib.import_module(f"{module.__name__}.{alias.name}")
        return bound

    module_names = bindings(ast.Module([n for n in tree.body if isinstance(n, ast.ImportFrom)], []))
    loaders, done = cli_loaders(), {}

    def resolve(func: ast.expr, names: dict) -> object | None:
        if isinstance(func, ast.Name):
            return names.get(func.id)
        if isinstance(func, ast.Attribute):
            owner = resolve(func.value, names)
            return None if owner is None else getattr(owner, func.attr, None)
        return None

    def calls(node: ast.AST, names: dict) -> list[str]:
        if isinstance(node, ast.If):
            return calls(node.test, names) + max(sum((calls(n, names) for n in node.body), []),
                                                  sum((calls(n, names) for n in node.orelse), []), key=len)
        if isinstance(node, ast.Name) and node.id in functions and node.id not in names:
            return command(node.id)  # a cli.py function, called or handed on (functools.partial(helper, args))
        found, children = [], list(ast.iter_child_nodes(node))
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "print":
                return []  # printing, and what is formatted for it
            target = resolve(node.func, names)
            if not (target is None or isinstance(target, type) or any(target == loader for loader in loaders)):
                found.append(ast.unparse(node.func))
            children = [child for child in children if child is not node.func or target is None]
        for child in children:
            found += calls(child, names)
        return found

    def command(name: str) -> list[str]:
        if name not in done:
            done[name] = []  # a helper that calls itself adds nothing more
            done[name] = sum((calls(n, {**module_names, **bindings(functions[name])}) for n in functions[name].body),
                             [])
        return done[name]

    return {name: command(name) for name in commands}


def model_reads(tree: ast.Module) -> list[str]:
    """Where a module reads a model's config (an --config flag is not one)."""
    return [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "config"
            and not (isinstance(node.value, ast.Name) and node.value.id == "args")]


def test_each_command_is_one_library_call():
    tree = ast.parse((ROOT / "cli.py").read_text())
    found = library_calls(tree)
    assert {"generate", "chat", "serve", "bench", "train", "dpo"} <= found.keys()  # the parser's commands, all seen
    recipes = {name: called for name, called in found.items() if len(called) != 1}
    assert not recipes, f"commands that are not one library call: {recipes}"
    assert not model_reads(tree), f"cli.py reads what a model is made of: {model_reads(tree)}"


def test_the_cli_rules_see_a_recipe():
    """The rules above, on the pretraining recipe cli.py held before it became training.pretrain, and on the
    perplexity window's defaults before evaluate.windowed_perplexity."""
    recipe = ast.parse('''
from .errors import SmolError

def train(args):
    from .config import PRESETS, SmolConfig
    from .model import SmolLM2
    from .training import train
    from .training.data import TokenData, split_tokens

    config = PRESETS.get(args.config) or SmolConfig.from_json(args.config)
    data = TokenData(args.data, "train", 512)
    if data.vocab_size > config.vocab_size:
        raise SmolError("too many tokens")
    model = SmolLM2(config)
    val = TokenData(args.data, "val", 512) if split_tokens(args.data, "val") else None
    final = train(model, None, data, val, None, args.out)
    print(f"the trained model is in {final}")

def perplexity(args):
    window = min(args.context, model.config.max_position_embeddings)

def parser():
    parser.set_defaults(run=train)
''')
    assert library_calls(recipe) == {"train": ["PRESETS.get", "SmolConfig.from_json", "split_tokens", "train"]}
    assert model_reads(recipe) == ["model.config"]
