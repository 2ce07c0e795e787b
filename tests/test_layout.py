"""The package's shape: no import cycle among its modules (imports inside functions count too), the swappable parts
satisfy their protocols, and the public names stay where users import them from."""

from __future__ import annotations

import ast
from pathlib import Path

import batchspec

SRC = Path(batchspec.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks (never executed)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    """Module -> the batchspec modules it imports (a package's ``__init__`` counts as the package)."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:  # ``import batchspec.x.y`` names the module; an attribute names its module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 60 and graph["batchspec.api"]  # the walk really read the package
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


ARCHITECTURE = SRC.parents[1] / "docs" / "architecture.md"


def _unit(module: str) -> str:
    """The layer unit of a module: its top-level package or module (``batchspec`` for the package's ``__init__``)."""
    return ".".join(module.split(".")[:2])


def documented_layers() -> list[set[str]]:
    """The units of each row of docs/architecture.md's layer table, top row first (``cli/`` -> ``batchspec.cli``,
    ``bench.py`` -> ``batchspec.bench``, ``__init__.py`` -> ``batchspec``)."""
    text = ARCHITECTURE.read_text()
    start = text.index("| layer | units |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = line.split("|")[2]
        names = [n.strip("` ") for n in cells.split(",")]
        rows.append({"batchspec" if n == "__init__.py" else "batchspec." + n.removesuffix("/").removesuffix(".py")
                     for n in names})
    return rows


def upward_imports(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """Imports from one unit into another that is not in a lower row of ``layers`` (top row first), and units the
    table does not place."""
    rank = {u: len(layers) - i for i, row in enumerate(layers) for u in row}
    bad = sorted({f"{_unit(m)} is not in the layer table" for m in graph if _unit(m) not in rank})
    for mod, targets in sorted(graph.items()):
        for t in sorted(targets):
            a, b = _unit(mod), _unit(t)
            if a != b and a in rank and b in rank and rank[b] >= rank[a]:
                bad.append(f"{mod} imports {t}: {b} is not below {a}")
    return bad


def test_imports_follow_the_documented_layers():
    layers = documented_layers()
    assert len(layers) >= 10 and {"batchspec.batch"} in layers and {"batchspec.model"} in layers
    assert upward_imports(import_graph(), layers) == []


def test_layer_check_finds_an_upward_import():
    layers = [{"batchspec.engine"}, {"batchspec.batch"}, {"batchspec.model"}]
    ok = {"batchspec.engine.engine": {"batchspec.batch.slots"}, "batchspec.batch.slots": {"batchspec.model.kv"},
          "batchspec.model.kv": set()}
    assert upward_imports(ok, layers) == []
    up = dict(ok, **{"batchspec.model.runner": {"batchspec.batch.slots"}})
    assert upward_imports(up, layers) == ["batchspec.model.runner imports batchspec.batch.slots: "
                                          "batchspec.batch is not below batchspec.model"]
    assert upward_imports({"batchspec.extra": set()}, layers) == ["batchspec.extra is not in the layer table"]


def test_parts_satisfy_their_protocols():
    from batchspec.drafters import NoDrafter, PromptLookup
    from batchspec.drafters.eagle import EagleDrafter
    from batchspec.drafters.model import ModelDrafter
    from batchspec.engine.layouts import LAYOUTS
    from batchspec.engine.protocols import Drafter, Layout, Scheduler, SpeculationPolicy
    from batchspec.engine.schedulers import Continuous, ExSpec, Static
    from batchspec.speculation import POLICIES

    assert all(isinstance(cls(), Layout) for cls in LAYOUTS.values())
    assert all(isinstance(s, Scheduler) for s in (Static(), Continuous(), ExSpec()))
    assert all(isinstance(cls(), SpeculationPolicy) for cls in POLICIES.values())
    assert isinstance(NoDrafter(), Drafter) and isinstance(PromptLookup(), Drafter)
    for cls in (EagleDrafter, ModelDrafter):  # members checked on the class (building one needs models)
        assert all(hasattr(cls, m) for m in ("prefill", "propose", "commit", "states", "processed", "needs_hidden"))
    assert not isinstance(object(), Layout)


def test_public_names():
    import batchspec.audit

    assert batchspec.LLM and batchspec.SamplingParams and batchspec.RequestOutput and batchspec.InvariantError
    assert callable(batchspec.audit) and batchspec.audit.__module__ == "batchspec.audit.core"


def deciders(graph_files: dict[str, Path]) -> list[str]:
    """Modules outside ``speculation/`` that decide a round's length: they call the pricing routine (``cheapest``,
    ``likeliest``, ``plan``/``round_costs`` of a planner, ``Planner()``) or take an argmax over costs."""
    decide = {"cheapest", "likeliest", "round_costs", "Planner", "Copies", "HeadRate"}
    bad = []
    for mod, path in sorted(graph_files.items()):
        if mod.startswith("batchspec.speculation"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in decide:
                bad.append(f"{mod} calls {name}")
            elif name == "argmax" and any(w in ast.unparse(node).lower() for w in ("cost", "verify", "price")):
                bad.append(f"{mod} takes an argmax over costs")
    return bad


def test_only_speculation_decides_a_rounds_length():
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    assert deciders({m: p for m, p in files.items() if m.startswith(("batchspec.drafters", "batchspec.engine"))}) == []


def test_decider_check_finds_a_drafter_that_prices(tmp_path):
    drafter = tmp_path / "drafter.py"
    drafter.write_text("def propose(chance, budget):\n    return (chance / budget.verify_tensor(3, 'cpu')).argmax()\n")
    pricing = tmp_path / "pricing.py"
    pricing.write_text("from batchspec.speculation.plan import cheapest\ncheapest(a, b)\n")
    assert deciders({"batchspec.drafters.x": drafter, "batchspec.engine.y": pricing}) == [
        "batchspec.drafters.x takes an argmax over costs", "batchspec.engine.y calls cheapest"]
