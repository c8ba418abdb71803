"""Where a deployment's tools live: ``module:attribute`` names, in ``$TETHER_TOOLS`` (the
default of ``Supervisor(tools=...)`` and of ``tether reconcile --tools``), imported so that a
supervisor opened on a journal has the probes of the tools an earlier process used.

The journal records which tool each action used (its name), never where to import it from:
importing a module a journal row names would run code chosen by whoever can write the journal,
and trust belongs to the deployment (docs/security.md). The deployment says where its tools
live, as it says where its journal is.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from tether._core.errors import UserError
from tether._runtime.tools import Agent, Tool

TOOLS_ENV = "TETHER_TOOLS"
HOW = (f"say where the tools live: {TOOLS_ENV}=module:attribute (or Supervisor(tools=...), "
       "tether reconcile --tools)")


def specs_of(text: str) -> list[str]:
    """``module:attribute`` names separated by commas or spaces."""
    return [s for s in re.split(r"[\s,]+", text) if s]


def _load(spec: str, where: str) -> list[Tool | Agent]:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise UserError(f"{where} {spec!r}: expected module:attribute, e.g. myapp.tools:ALL")
    try:
        found: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # missing, or failing (or exiting) as imported
        # A sys.exit() in a module's body would end the process that asked, silently (exit 0).
        raise UserError(f"{where} {spec!r}: cannot import {module_name}: "
                        f"{type(exc).__name__}: {exc}") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise UserError(f"{where} {spec!r}: {module_name} has no attribute {attribute}")
        found = getattr(found, part)
    if isinstance(found, Mapping):
        found = list(found.values())
    items = list(found) if isinstance(found, list | tuple | set | frozenset) else [found]
    for item in items:
        if not isinstance(item, Tool | Agent):
            raise UserError(f"{where} {spec!r}: {_shown(item)} is not a tether tool or agent")
    return items


def _shown(item: object) -> str:
    try:
        return repr(item)
    except Exception:  # a repr that raises says nothing of the declaration: its type does
        return f"a {type(item).__name__}"


def tools_by_name(items: Iterable[Tool | Agent | str], where: str) -> dict[str, Tool]:
    """Every tool of ``items``, those of agents (adapter-built ones included) at any depth.
    Two tools of one name with different probes are refused: which one settles a call of
    that name could not be told."""
    found: dict[str, Tool] = {}

    def visit(item: Tool | Agent | str) -> None:
        if isinstance(item, Agent):
            for inner in item.tools:
                visit(inner)
        elif isinstance(item, Tool):
            known = found.setdefault(item.name, item)
            if known is not item and known.probe != item.probe:
                raise UserError(f"{where}: two tools are named {item.name!r} with different "
                                "probes; a call of that name could be settled by either")

    for item in items:
        visit(item)
    return found


def load_tools(specs: Iterable[str], where: str) -> dict[str, Tool]:
    """The tools that ``module:attribute`` names hold: a Tool, an Agent, or a list or mapping
    of them."""
    return tools_by_name([i for spec in specs for i in _load(spec, where)], where)


def deployment_tools() -> dict[str, Tool]:
    """The tools ``$TETHER_TOOLS`` names (none when it is unset or empty)."""
    return load_tools(specs_of(os.environ.get(TOOLS_ENV, "")), TOOLS_ENV)
