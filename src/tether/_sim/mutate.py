"""Re-introducing a fixed defect into the code that ships, for as long as a trial runs.

A mutation is a literal edit of one production module's source: this text, found exactly once,
becomes that text. The edited module is compiled under its own file name, and every function
of the module whose compiled code changed has its ``__code__`` swapped for the edited one, so
every caller, whichever name it imported the function by, runs the defect; leaving the
``with`` block puts the original code back. Nothing is imported twice and no module object is
replaced, so what runs is the shipped code with one edit, not a copy of it.

An edit whose text is no longer in the source is refused (``MutationStale``): the code moved
on, and the catalogue must say again what the defect looks like in it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class MutationStale(Exception):
    """The text a mutation edits is not (or not exactly once) in its module's source."""


@dataclass(frozen=True)
class Edit:
    module: str  # e.g. "tether._runtime.reconcile"
    old: str
    new: str


def _codes(code: types.CodeType) -> dict[str, types.CodeType]:
    """Every function's code compiled from a module, by qualified name (classes' bodies
    included, and functions nested in functions)."""
    found: dict[str, types.CodeType] = {}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name != "<module>":
                found.setdefault(const.co_qualname, const)
            found.update({k: v for k, v in _codes(const).items() if k not in found})
    return found


def _functions(module: types.ModuleType) -> dict[str, types.FunctionType]:
    """The module's own functions and methods, by qualified name, unwrapped from decorators."""
    found: dict[str, types.FunctionType] = {}

    def add(value: Any) -> None:
        for _ in range(8):  # decorators that keep ``__wrapped__`` (functools.wraps)
            if isinstance(value, staticmethod | classmethod):
                value = value.__func__
            elif isinstance(value, property):
                for part in (value.fget, value.fset, value.fdel):
                    if part is not None:
                        add(part)
                return
            elif isinstance(value, types.FunctionType) and hasattr(value, "__wrapped__"):
                found.setdefault(value.__qualname__, value)
                value = value.__wrapped__
            else:
                break
        if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            found.setdefault(value.__qualname__, value)

    for value in vars(module).values():
        if isinstance(value, type) and value.__module__ == module.__name__:
            for member in vars(value).values():
                add(member)
        else:
            add(value)
    return found


def _lookup(module: types.ModuleType, qualname: str) -> object:
    value: object = module
    for part in qualname.split("."):
        value = getattr(value, part, None)
    return value


def _same(a: types.CodeType, b: types.CodeType) -> bool:
    """Equal but for where the lines are (an edit above a function moves it)."""
    def shape(c: types.CodeType) -> tuple[Any, ...]:
        consts = tuple(shape(k) if isinstance(k, types.CodeType) else k for k in c.co_consts)
        return (c.co_code, consts, c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)
    return shape(a) == shape(b)


def changed(edit: Edit) -> dict[types.FunctionType, types.CodeType]:
    """The live functions an edit changes, with their edited code (raises MutationStale)."""
    module = importlib.import_module(edit.module)
    source = inspect.getsource(module)
    count = source.count(edit.old)
    if count != 1:
        raise MutationStale(f"{edit.module}: the text to edit is there {count} times, not "
                            f"once: {edit.old.strip()[:80]!r}")
    filename = module.__file__ or edit.module
    before = _codes(compile(source, filename, "exec"))
    after = _codes(compile(source.replace(edit.old, edit.new), filename, "exec"))
    live = _functions(module)
    swaps: dict[types.FunctionType, types.CodeType] = {}
    for name, code in after.items():
        if name in before and _same(before[name], code):
            continue
        # The outermost live function holding the change (a nested one is a constant of it).
        holder = name
        while holder not in live and "." in holder:
            holder = holder.rsplit(".", 1)[0].removesuffix(".<locals>")
        if holder not in live and isinstance(_lookup(module, name), type):
            continue  # a class body: its methods' code is swapped one by one
        if holder not in live:
            raise MutationStale(f"{edit.module}: the edit changes {name}, which is no "
                                f"function of the module")
        swaps[live[holder]] = after[holder]
    if not swaps:
        raise MutationStale(f"{edit.module}: the edit changes no function")
    return swaps


@contextlib.contextmanager
def applied(*edits: Edit) -> Iterator[None]:
    """Run the block with the edits in the shipped code; the original code back after."""
    swaps: dict[types.FunctionType, types.CodeType] = {}
    for edit in edits:
        swaps.update(changed(edit))
    kept = {f: f.__code__ for f in swaps}
    try:
        for f, code in swaps.items():
            f.__code__ = code
        yield
    finally:
        for f, code in kept.items():
            f.__code__ = code


__all__ = ["Edit", "MutationStale", "applied", "changed"]
