"""The layer rules of docs/design.md ("Layers"), read from the source with ``ast``.

Every import counts, wherever it is: at module level, under ``if TYPE_CHECKING:`` or inside a
function. A type-only import still couples two modules, and a cycle hidden behind one is what
these rules exist to keep out.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

from tether._core.model import ActionState, DelegationState
from tether._core.outcome import KEY_FREE
from tether._journal.schema import MIGRATIONS

SRC = Path(__file__).resolve().parents[1] / "src"
CORE_MAY_NOT_IMPORT = frozenset({"asyncio", "sqlite3", "psycopg", "threading", "time", "socket",
                                 "os"})


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted((SRC / "tether").rglob("*.py"))}


def _imported(name: str, path: Path) -> Iterator[str]:
    """Every module ``name`` imports, by absolute name (``from a import b`` names ``a.b`` when
    that is a module of ours, else ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    yield f"{base}.{alias.name}"


IMPORTS: dict[str, set[str]] = {name: set(_imported(name, path))
                                for name, path in MODULES.items()}


def _ours(name: str) -> set[str]:
    """The tether modules ``name`` imports (a package's ``__init__`` counts as a module)."""
    return {m for m in IMPORTS[name] if m in MODULES and m != name}


def _cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v] & graph.keys()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _under(package: str) -> set[str]:
    return {m for m in MODULES if m == package or m.startswith(package + ".")}


def test_the_parser_sees_every_kind_of_import() -> None:
    # Guards the rules below against passing vacuously.
    assert "tether._runtime.gateway" in IMPORTS["tether._runtime.supervisor"]
    assert "opentelemetry.metrics" in IMPORTS["tether._runtime.supervisor"]  # TYPE_CHECKING
    assert "tether._journal.ops" in IMPORTS["tether._runtime.remote"]  # from a package import b
    assert "asyncio" in IMPORTS["tether._runtime.clock"]


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c", "x"}, "c": {"a"}, "d": {"a"}, "e": {"d"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle() -> None:
    """No two modules anywhere in tether import one another, directly or transitively (a
    function-level import included): a layer that needs another's private helper gets it moved
    to where both can import it."""
    cycles = _cycles({m: _ours(m) for m in MODULES})
    assert not cycles, ("tether modules that import one another, directly or transitively: "
                        + "; ".join(", ".join(c) for c in cycles))


def test_the_core_does_no_io() -> None:
    offending = {m: sorted(i for i in IMPORTS[m] if i.split(".")[0] in CORE_MAY_NOT_IMPORT)
                 for m in _under("tether._core")}
    assert not {m: i for m, i in offending.items() if i}


def test_the_core_imports_no_other_layer() -> None:
    offending = {m: sorted(i for i in IMPORTS[m] if i.split(".")[0] == "tether"
                           and i not in _under("tether._core"))
                 for m in _under("tether._core")}
    assert not {m: i for m, i in offending.items() if i}


def test_the_layers_below_the_command_line_do_not_import_it() -> None:
    """``_cli`` holds the commands' terminal side (typer, rich). The core, journal, runtime
    and simulator never import it: the simulator runs ``tether verify``'s check from
    ``_runtime.audit``, as the command does."""
    below = ("tether._core", "tether._journal", "tether._runtime", "tether._sim")
    offending = {m: sorted(i for i in IMPORTS[m] if i.startswith("tether._cli"))
                 for m in MODULES if m.startswith(below)}
    assert not {m: i for m, i in offending.items() if i}


def test_nothing_waits_with_asyncio_wait_for() -> None:
    """On Python 3.11, ``asyncio.wait_for`` returns what it waited for when that is done as
    the waiting task is cancelled: the cancel is lost (a worker's lease task once renewed for
    ever after its cancel, and the worker never exited on SIGTERM). ``asyncio.timeout`` and
    ``asyncio.wait`` keep it."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "wait_for" and \
                    isinstance(node.value, ast.Name) and node.value.id == "asyncio":
                found.append(f"{name}:{node.lineno}")
    assert found == [], found


_STATES = "|".join(sorted({s.value for s in (*ActionState, *DelegationState)}, key=len,
                          reverse=True))
_STATE_IN_SQL = re.compile(rf"'({_STATES})'")
# Frozen history: a migration states what a schema version was (its live-key index is checked
# against the core's rule below).
_HISTORY = {"tether._journal.schema"}


def test_no_state_is_chosen_in_sql() -> None:
    """Which state a statement reads or writes is the core's (``_core.model``, ``outcome``),
    bound as a parameter: a state written into SQL text is a decision taken outside the core
    (docs/design.md, "No state is chosen in SQL")."""
    found = []
    for name, path in MODULES.items():
        if name.startswith(("tether._core", "tether._sim")) or name in _HISTORY:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [f"{name}:{node.lineno}: {m.group(0)}"
                          for m in _STATE_IN_SQL.finditer(node.value)]
    assert found == []


def test_the_live_key_index_frees_exactly_the_cores_free_outcomes() -> None:
    """The schema's partial unique index lets a key be used again only after the outcomes the
    core says prove nothing applied (``KEY_FREE``, I7)."""
    ddl = next(s for steps in MIGRATIONS.values() for s in steps
               if isinstance(s, str) and "actions_live_key" in s)
    listed = re.search(r"NOT IN \(([^)]*)\)", ddl)
    assert listed is not None, ddl
    assert {v.strip().strip("'") for v in listed.group(1).split(",")} == \
        {s.value for s in KEY_FREE}


# A placeholder row, never written: a handle known only by id has read nothing of it yet.
_NOT_A_MOVE = {("tether._runtime.handle", "DelegationState.RUNNING")}


def _chosen_states(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Each ``DelegationState.X`` / ``ActionState.X`` that is not read in a comparison (``is``,
    ``in``, ``==``): a state the code names to write, return or pass on is one it chose."""
    compared: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for part in (node.left, *node.comparators):
                compared |= {id(n) for n in ast.walk(part)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in ("DelegationState", "ActionState", "_S", "_A")
                and node.attr.isupper() and id(node) not in compared):
            yield node.lineno, f"{node.value.id}.{node.attr}"


def test_the_runtime_chooses_no_state() -> None:
    """Every state a delegation or action moves to is the core's decision (``_core.model``:
    ``receipt_of``, ``ControlKind.settled``, ``code_ended``, ``FORK_REFUSED``...); the runtime
    reads states, it does not name the one to write (docs/design.md)."""
    found = []
    for name, path in MODULES.items():
        if not name.startswith("tether._runtime"):
            continue
        for line, state in _chosen_states(ast.parse(path.read_text(encoding="utf-8"))):
            if (name, state) not in _NOT_A_MOVE:
                found.append(f"{name}:{line}: {state}")
    assert found == []


def test_the_state_finder_tells_a_choice_from_a_reading() -> None:
    tree = ast.parse("if s is ActionState.FAILED or s in (DelegationState.RUNNING,): pass\n"
                     "journal.finish(a, ActionState.COMPLETED)\nx = _S.FAILED\n")
    assert sorted(_chosen_states(tree)) == [(2, "ActionState.COMPLETED"), (3, "_S.FAILED")]
