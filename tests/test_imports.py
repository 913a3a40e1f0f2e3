"""The import graph of the repository, read from the source (no module is imported):

- no cycles among the modules of k3jax/, train/ and eval/, counting imports inside functions too
  (a submodule's implicit import of its own parent package is not an edge);
- the library (k3jax/) never imports the launcher (train/) or the evaluation programs (eval/);
- tests and benchmarks import nothing from train/ but the tests of its CLIs;
- running a model has one home, `k3jax.inference`: it takes from `k3jax.training` only the model's
  parts (`state`, `finetune`); the server needs nothing of training and nothing of the eval
  program's CLI; no evaluation program imports the trainers;
- benchmarks use the library, never the eval programs (they start those as subprocesses);
- the server's request checking (its request models, parameters and error type) does not depend on
  its engine;
- the speculator drives the session store through its public API only (no ``store._name``).
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROGRAMS = ("k3jax", "train", "eval")
CLI_TESTS = {"tests/train/test_cli.py", "tests/train/test_launcher.py",
             "tests/train/test_rl_runs.py"}     # its hung-reward test checks the CLI's one line


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(*tops: str) -> list[pathlib.Path]:
    return sorted(path for top in tops for path in (ROOT / top).rglob("*.py"))


def imported(path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports anywhere in it: ``from a import b`` counts as
    ``a.b`` when that is a module, else as ``a``; relative imports are resolved."""
    name = module_name(path) if path.is_relative_to(ROOT / "k3jax") or path.parts[-2] in PROGRAMS else ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {module for module in found if module in known}


def program_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in python_files(*PROGRAMS)}
    known = set(files)
    graph = {}
    for name, path in files.items():
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = imported(path, known) - ancestors - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(program_graph()) == []


def test_the_library_never_imports_the_programs():
    graph = program_graph()
    offenders = {name: sorted(t for t in targets if t.split(".")[0] in ("train", "eval"))
                 for name, targets in graph.items() if name.startswith("k3jax")}
    assert {name: targets for name, targets in offenders.items() if targets} == {}


def test_tests_and_benchmarks_use_the_launcher_only_to_test_its_clis():
    known = set(program_graph())
    users = [str(path.relative_to(ROOT)) for path in python_files("tests", "bench")
             if any(module.split(".")[0] == "train" for module in imported(path, known))]
    assert sorted(set(users) - CLI_TESTS) == []


def imports_of(prefix: str) -> dict[str, set[str]]:
    """{module: the modules of k3jax/, train/, eval/ it imports} for the modules under ``prefix``
    (``bench``: the benchmarks, read from their files)."""
    if prefix == "bench":
        known = set(program_graph())
        return {module_name(path): imported(path, known) for path in python_files("bench")}
    return {name: targets for name, targets in program_graph().items() if name == prefix or name.startswith(f"{prefix}.")}


def offenders(prefix: str, forbidden, allowed=()) -> dict[str, list[str]]:
    """The modules under ``prefix`` that import a module under one of ``forbidden`` that is not
    under one of ``allowed`` -> what they import."""
    under = lambda module, tops: any(module == top or module.startswith(f"{top}.") for top in tops)  # noqa: E731
    found = {name: sorted(t for t in targets if under(t, forbidden) and not under(t, allowed))
             for name, targets in imports_of(prefix).items()}
    return {name: targets for name, targets in found.items() if targets}


def test_the_rule_finder_finds_a_planted_import(monkeypatch):
    monkeypatch.setitem(globals(), "program_graph", lambda: {"eval.serve.x": {"k3jax.training.trainer"}, "eval.y": set()})
    assert offenders("eval.serve", ["k3jax.training"]) == {"eval.serve.x": ["k3jax.training.trainer"]}
    assert offenders("eval.serve", ["k3jax.training"], allowed=["k3jax.training.trainer"]) == {}


def test_running_a_model_takes_only_the_models_parts_from_training():
    assert offenders("k3jax.inference", ["k3jax.training", "train", "eval"],
                     allowed=["k3jax.training.state", "k3jax.training.finetune"]) == {}


def test_the_server_needs_nothing_of_training_nor_of_the_eval_cli():
    assert offenders("eval.serve", ["k3jax.training", "train", "eval.cli"]) == {}


def test_no_evaluation_program_imports_a_trainer():
    assert offenders("eval", ["k3jax.training.trainer", "k3jax.training.rl", "k3jax.training.rollout"]) == {}


def test_benchmarks_use_the_library_not_the_eval_programs():
    assert offenders("bench", ["eval"]) == {}


def test_request_checking_does_not_depend_on_the_engine():
    for module in ("eval.serve.protocol", "eval.serve.params", "eval.serve.errors"):
        assert offenders(module, ["eval.serve.engine", "eval.serve.server", "eval.serve.app"]) == {}, module


def private_store_uses(path: pathlib.Path) -> list[str]:
    """``store._name`` (or ``self.store._name``) attribute reads in ``path``, as ``line: name``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name == "store":
                found.append(f"{node.lineno}: {node.attr}")
    return found


def test_private_store_use_finder_finds_a_planted_use(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(store, self):\n    store._device\n    self.store._counters\n    store.feeder\n")
    assert private_store_uses(planted) == ["2: _device", "3: _counters"]


def test_the_speculator_uses_only_the_stores_public_api():
    assert private_store_uses(ROOT / "k3jax/sessions/speculate.py") == []
