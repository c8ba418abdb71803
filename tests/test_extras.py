"""``import tether`` works without any framework extra installed; each adapter then says which
extra to install (one line, the package to ``pip install``)."""

from __future__ import annotations

import subprocess
import sys

# Runs in a fresh interpreter where the frameworks cannot be imported, as on a machine
# without the extras.
SCRIPT = r"""
import importlib, sys

BLOCKED = ("agents", "openai", "httpx2", "langgraph", "langchain_core", "pydantic_ai",
           "temporalio")

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Block())
import tether, tether.conformance, tether.testing
print("tether", tether.Supervisor.__name__)
for module in ("tether.openai_agents", "tether.agents", "tether.langgraph", "tether.pydantic_ai",
               "tether.temporal"):
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        print(module, "->", exc)
    else:
        print(module, "imported")
"""


def test_tether_imports_without_the_framework_extras() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True).stdout
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    assert lines["tether"] == "Supervisor"
    for module, extra in (("tether.openai_agents", "openai-agents"),
                          ("tether.agents", "openai-agents"),
                          ("tether.langgraph", "langgraph"),
                          ("tether.pydantic_ai", "pydantic-ai"),
                          ("tether.temporal", "temporal")):
        assert lines[module].startswith("-> ") and \
            lines[module].endswith(f"pip install 'tether[{extra}]'"), out
