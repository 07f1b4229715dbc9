"""The layering rule of docs/architecture.md, checked on the source: a layer imports only
layers below it (imports inside functions included), and the layers below the Ray layer
never import Ray's training or core API."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ray_checkfreq"
# Lowest first. Shared by all: errors (exceptions only). The package's __init__ and the
# front ends at the top (chaos, cli) may import anything below them. The repository's
# top-level benchmarks/ package sits above all of it and is never imported by the library.
LAYERS = ["errors", "codec", "storage", "engine", "data", "ray", "integrations", "chaos", "cli"]
SIDEWAYS_OK = {("cli", "chaos")}  # front ends beside each other
RAY_FREE = ("codec", "storage", "engine")


def layer_of(module: str) -> str | None:
    """``ray_checkfreq.storage.store`` -> ``storage``; the package itself -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "ray_checkfreq" else None


def imports_of(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "ray_checkfreq":  # from ray_checkfreq import codec
                found += [(node.lineno, f"ray_checkfreq.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def source_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def upward_imports(files: list[Path], root: Path = PACKAGE) -> list[str]:
    bad = []
    for path in files:
        own = layer_of("ray_checkfreq." + ".".join(path.relative_to(root).with_suffix("").parts))
        if own not in LAYERS:
            continue  # the package's __init__: the public API, above every layer
        for line, module in imports_of(path):
            other = layer_of(module)
            if other is None or other == own or other not in LAYERS or (own, other) in SIDEWAYS_OK:
                continue
            if LAYERS.index(other) > LAYERS.index(own):
                bad.append(f"{path.relative_to(root.parent)}:{line}: {own} imports {module}")
    return bad


def test_every_module_belongs_to_a_known_layer() -> None:
    for path in source_files():
        rel = path.relative_to(PACKAGE)
        if rel.parts == ("__init__.py",):
            continue
        name = rel.parts[0].removesuffix(".py")
        assert name in LAYERS, f"{rel}: not in any layer of docs/architecture.md ({LAYERS})"


def test_no_layer_imports_a_layer_above_it() -> None:
    assert upward_imports(source_files()) == []


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    storage = tmp_path / "ray_checkfreq" / "storage"
    storage.mkdir(parents=True)
    module = storage / "sneaky.py"
    module.write_text("def f():\n    from ray_checkfreq.ray.session import CheckFreq\n")
    found = upward_imports([module], root=tmp_path / "ray_checkfreq")
    assert found == ["ray_checkfreq/storage/sneaky.py:2: storage imports ray_checkfreq.ray.session"]


def test_the_library_never_imports_the_benchmarks() -> None:
    # The CLI's `bench` loads benchmarks/ by name at run time (importlib), from a checkout only.
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {module}" for path in source_files()
             for line, module in imports_of(path) if module.split(".")[0] == "benchmarks"]
    assert found == []


@pytest.mark.parametrize("layer", RAY_FREE)
def test_layers_below_data_never_import_ray(layer: str) -> None:
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in imports_of(path):
            assert module != "ray" and not module.startswith("ray."), f"{path}:{line} imports {module}"


# Module-level import circles (imports inside functions and under TYPE_CHECKING count:
# both tie the two modules together). Each entry is a circle not yet taken apart; the
# test fails on a new circle and on an entry that no longer exists, so the list only shrinks.
KNOWN_CIRCLES: list[list[str]] = []


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(files: list[Path], root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name resolves to its longest module
    prefix; a module's own packages are left out: importing them is not a circle)."""
    modules = {module_name(path, root): path for path in files}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.startswith("ray_checkfreq") else None
                if found and found != name and not name.startswith(found + "."):
                    graph[name].add(found)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def test_no_new_import_circles() -> None:
    assert import_circles(import_graph(source_files())) == sorted(KNOWN_CIRCLES)


def test_the_circle_check_catches_a_circle(tmp_path: Path) -> None:
    engine = tmp_path / "ray_checkfreq" / "engine"
    engine.mkdir(parents=True)
    (engine / "__init__.py").write_text("")
    (engine / "a.py").write_text("from ray_checkfreq.engine.b import thing\n")
    (engine / "b.py").write_text("def f():\n    from ray_checkfreq.engine import a\n")
    (engine / "c.py").write_text("from ray_checkfreq.engine import a\n")
    files = sorted(engine.glob("*.py"))
    graph = import_graph(files, root=tmp_path / "ray_checkfreq")
    assert import_circles(graph) == [["ray_checkfreq.engine.a", "ray_checkfreq.engine.b"]]


def trainer_builders(paths: list[Path]) -> list[str]:
    """Every ``TorchTrainer(...)`` call in ``paths``: where it is."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            name = getattr(node, "func", None)
            if isinstance(node, ast.Call) and getattr(name, "id", getattr(name, "attr", None)) == "TorchTrainer":
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_only_the_job_harness_builds_a_trainer_outside_the_examples() -> None:
    # The examples are users' scripts and show TorchTrainer as a user writes it; chaos, the
    # demo, the benchmarks and the tests run their jobs through ray_checkfreq/chaos/harness.py.
    repo = PACKAGE.parent
    paths = [p for folder in ("ray_checkfreq", "benchmarks", "tests") for p in (repo / folder).rglob("*.py")]
    builders = trainer_builders(paths)
    assert len(builders) == 1 and builders[0].startswith("harness.py:"), builders


def test_the_trainer_check_sees_a_second_builder(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("from ray.train.torch import TorchTrainer\ntrainer = TorchTrainer(lambda c: None)\n")
    assert trainer_builders([script]) == ["job.py:2"]


# ------------------------------------------------------------------ one store
def store_type_tests(paths: list[Path]) -> list[str]:
    """``isinstance`` calls naming a store class: outside ``storage/``, code branches on
    the state's placement, never on which store it holds (there is one)."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                names = {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node.args[1])}
                if any(name.endswith("Store") for name in names):
                    found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_module_outside_storage_tests_the_store_type() -> None:
    paths = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "storage"]
    assert store_type_tests(paths) == []


def test_the_store_type_check_sees_a_branch(tmp_path: Path) -> None:
    module = tmp_path / "engine.py"
    module.write_text("def f(store):\n    if isinstance(store, (dict, storage.ShardedStore)):\n        pass\n")
    assert store_type_tests([module]) == ["engine.py:2"]
