"""`tether mcp-proxy --config FILE`: the mcpServers file MCP hosts use, with tether's keys
beside the standard ones; each upstream gets only the environment it is given, its own working
directory, probes named module:attr (imported from the file's folder without shadowing the
modules the proxy imports later), a tool-name prefix; every mistake is one line."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import tether
from tests.mcp_helpers import PYTHONPATH, ROOT, connect, paid, text
from tests.remote_agents import listen_gate
from tests.test_mcp_proxy import INITIALIZE, cli

A = tether.ActionState


def bank_entry(**tether_keys: Any) -> dict[str, Any]:
    return {"command": sys.executable, "args": ["-m", "tests.mcp_bank"],
            "env": {"PYTHONPATH": PYTHONPATH,
                    **{k: v for k, v in os.environ.items() if k.startswith("TETHER_TEST_")}},
            **tether_keys}


def write(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps(config))
    return path


async def delegation(journal: str) -> tether.Report:
    async with tether.Journal(journal, create=False) as j:
        (row,) = await j.delegations()
        from tether._runtime.reconcile import build_report

        return await build_report(j, row.id)


async def test_a_config_file_names_env_cwd_probes_prefix_and_session(
        bank_env: Path, tmp_path: Path) -> None:
    (tmp_path / "shelf").mkdir()
    config = write(tmp_path, {"session": "billing-agent", "mcpServers": {
        "bank": bank_entry(effects={"pay": "external"}, probes={"pay": "tests.mcp_probes:bank_pay"},
                           deadlines={"pay": 0.5}),
        "twin": bank_entry(prefix="twin_"),
        "library": {"command": sys.executable, "args": ["-m", "tests.mcp_library"],
                    "cwd": "shelf", "env": {"PYTHONPATH": PYTHONPATH, "LIBRARY_MODE": "quiet"}},
    }})
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--config", str(config),
                       "--journal", journal, env={"SECRET_TOKEN": "s3cr3t"}) as session:
        names = {t.name for t in (await session.list_tools()).tools}
        where = (await session.call_tool("whereami", {})).structured_content
        started = await listen_gate("started")
        cancelled = await listen_gate("cancelled")
        call = asyncio.ensure_future(session.call_tool("pay", {"account": "hold-5", "cents": 5}))
        await started
        call.cancel()  # cancelled upstream, then probed with the config's probe
        assert await asyncio.wait_for(cancelled, 30) == "hold-5"
        twin = await session.call_tool("twin_pay", {"account": "T-1", "cents": 2})
        # Before its dispatch deadline (plus the clock tolerance: another host's clock may
        # have written it) the bank's "no entry" means "not applied yet"; the session's end
        # probes it again, past both, when the answer is final.
        cut = await probed(journal, "bank.pay")
        assert cut.state is A.IN_DOUBT and cut.deadline_at is not None
        final = cut.deadline_at + tether.Policy().clock_tolerance
        await asyncio.sleep(max(0.0, final - time.time()))
    assert {"pay", "twin_pay", "balance", "twin_balance", "whereami"} <= names
    assert where is not None and where["cwd"] == str(tmp_path / "shelf")
    assert "LIBRARY_MODE" in where["env"] and "SECRET_TOKEN" not in where["env"]
    assert not twin.is_error and text(twin) == "paid 2 to T-1"
    report = await delegation(journal)
    assert report.agent == "billing-agent"
    states = {(a.tool, a.state) for a in report.actions}
    # The cancelled payment: probed past its deadline and the clock tolerance, proved not
    # applied (the bank's ledger).
    assert ("bank.pay", A.NOT_APPLIED) in states and ("twin.pay", A.COMPLETED) in states
    assert report.outcome is tether.DelegationState.RECONCILED
    assert paid(bank_env, "hold-5") == []


async def test_the_default_journal_is_per_user_not_per_directory(
        bank_env: Path, tmp_path: Path) -> None:
    state, elsewhere = tmp_path / "state", tmp_path / "host"
    elsewhere.mkdir()
    config = write(tmp_path, {"mcpServers": {"bank": bank_entry()}})
    async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--config", str(config),
                       "--session", "agent-7", cwd=elsewhere,
                       env={"XDG_STATE_HOME": str(state)}) as session:
        await session.call_tool("pay", {"account": "A-1", "cents": 1})
    assert (state / "tether" / "journal.db").exists()
    assert not (elsewhere / ".tether").exists()
    report = await delegation(f"sqlite:///{state / 'tether' / 'journal.db'}")
    assert report.agent == "agent-7"  # --session names it in `tether ls`


async def probed(journal: str, tool: str) -> tether.ActionRecord:
    """The action once its probe has answered (the proxy reconciles a cancel in the
    background), polled with a deadline."""
    give_up = time.monotonic() + 30
    while True:
        (action,) = [a for a in (await delegation(journal)).actions if a.tool == tool]
        if action.evidence is not None or time.monotonic() > give_up:
            return action
        await asyncio.sleep(0.05)


def quitter() -> dict[str, Any]:
    return {"command": sys.executable, "args": ["-c", "pass"]}


@pytest.mark.parametrize(("config", "message"), [
    ({"mcpServers": {"x": {}}}, "needs either 'command'"),
    ({"mcpServers": {"x": {"command": "y", "url": "http://127.0.0.1:1/mcp"}}}, "not both"),
    ({"mcpServers": {"x": {"command": "y", "efects": {}}}}, "'efects' was unexpected"),
    ({"mcpServers": {"x": {"command": "y", "effects": {"a": "SOMETIMES"}}}}, "'SOMETIMES'"),
    ({"mcpServers": {"x": {"command": "y", "probes": {"a": "no_such_module:probe"}}}},
     "cannot import probe"),
    ({"mcpServers": {"x": {"command": "y", "probes": {"a": "tests.mcp_probes:not_async"}}}},
     "must be an async function"),
    ({"mcpServers": {"bad name": {"command": "y"}}}, "does not match"),
    ({"mcpServers": {}, "sesion": "x"}, "'sesion' was unexpected"),
    ({"mcpServers": {"x": {"command": "/no/such/server"}}}, "cannot start upstream x"),
    ({"mcpServers": {"x": quitter()}}, "cannot start upstream x"),
    ({"mcpServers": {"bank": bank_entry(effects={"transfer": "EXTERNAL"})}},
     "does not offer: transfer"),
    ({"mcpServers": {"a": bank_entry(), "b": bank_entry()}}, "give one of them a tool-name prefix"),
])
async def test_config_mistakes_are_one_line(bank_env: Path, tmp_path: Path,
                                            config: dict[str, Any], message: str) -> None:
    path = write(tmp_path, config)
    code, out, err = await cli("mcp-proxy", "--journal", f"sqlite:///{tmp_path / 'j.db'}",
                               "--config", str(path))
    assert code == 2 and err.startswith("error:") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err + out


# The proxy with its stdin watchdog woken late, as on a loaded machine: it learns that the
# client left only ``LAG`` seconds after the upstreams answered (here, with an error), while
# the session is still unwinding.
LATE_WATCH = """
import asyncio, runpy, sys
from tether._integrations.mcp_serve import StdioSession
LAG = float(sys.argv.pop(1))
watch = StdioSession.watch
async def late(self, ended):
    lagged = asyncio.Event()
    async def relay():
        await ended.wait()
        await self.answered.wait()
        await asyncio.sleep(LAG)
        lagged.set()
    relaying = asyncio.ensure_future(relay())
    try:
        await watch(self, lagged)
    finally:
        relaying.cancel()
StdioSession.watch = late
sys.argv[0] = "tether"
runpy.run_module("tether", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("lag", [0.0, 0.02, 0.1])
async def test_a_config_mistake_is_reported_however_late_the_client_is_seen_leaving(
        bank_env: Path, tmp_path: Path, lag: float) -> None:
    """The client sends ``initialize`` and leaves at once; the upstream lacks a tool the
    config names. Whenever the proxy notices the client left, the mistake is its answer:
    exit 2 and one line, never a clean exit with nothing said."""
    path = write(tmp_path, {"mcpServers": {"bank": bank_entry(effects={"transfer": "EXTERNAL"})}})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LATE_WATCH, str(lag), "mcp-proxy", "--journal",
        f"sqlite:///{tmp_path / 'j.db'}", "--config", str(path), cwd=ROOT,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate(INITIALIZE)
    said = err.decode()
    assert proc.returncode == 2 and said.startswith("error:"), (proc.returncode, said)
    assert "does not offer: transfer" in said and len(said.strip().splitlines()) == 1


async def test_an_upstream_named_twice_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, {"mcpServers": {"bank": {"command": "x"}}})
    code, _, err = await cli("mcp-proxy", "--config", str(path), "--upstream", "bank=y",
                             "--journal", f"sqlite:///{tmp_path / 'j.db'}")
    assert code == 2 and "also in the MCP config file" in err and len(err.splitlines()) == 1


def test_mcp_config_probes_do_not_shadow_modules_imported_later(tmp_path: Path) -> None:
    """A config's probe is imported from the file's folder; that folder must not go first on
    the import path for good, or any module the proxy imports later (uvicorn when serving
    HTTP, the SDK's lazy imports) is taken from the folder instead."""
    from tether._integrations.mcp_config import load_config

    (tmp_path / "myprobes.py").write_text("async def landed(**_):\n    return None\n")
    (tmp_path / "colorsys.py").write_text("SHADOWED = True\n")
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"bank": {
        "command": "true", "probes": {"pay": "myprobes:landed"}}}}))
    before = list(sys.path)
    saved = sys.modules.pop("colorsys", None)
    try:
        loaded = load_config(config)
        import colorsys

        assert not hasattr(colorsys, "SHADOWED")
    finally:
        sys.path[:] = before
        sys.modules.pop("colorsys", None)
        sys.modules.pop("myprobes", None)
        if saved is not None:
            sys.modules["colorsys"] = saved
    assert loaded.policies["bank"].probes["pay"].__name__ == "landed"


def test_a_config_servers_environment_is_the_sdks_default_plus_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy starts its upstreams before it imports the MCP SDK, with the SDK's default
    environment read by tether: held here to the SDK's own."""
    from mcp.client.stdio import get_default_environment

    from tether._integrations.mcp_children import environment
    from tether._integrations.mcp_config import UpstreamSpec

    monkeypatch.setenv("SHELL", "() { evil; }")  # a shell function: neither passes it on
    monkeypatch.setenv("SECRET_TOKEN", "s3cr3t")
    spec = UpstreamSpec("x", ("true",), env={"MODE": "quiet"})
    assert environment(spec) == {**get_default_environment(), "MODE": "quiet"}
    assert "SHELL" not in environment(spec) and "SECRET_TOKEN" not in environment(spec)
    assert environment(UpstreamSpec("y", ("true",)))["SECRET_TOKEN"] == "s3cr3t"


def test_a_config_server_the_os_cannot_start_is_one_error_line(tmp_path: Path) -> None:
    """An env name with '=' (or a NUL byte) is refused by the OS's exec: one line, exit 2."""
    import subprocess

    config = write(tmp_path, {"mcpServers": {"a": {"command": "sleep", "args": ["600"],
                                                  "env": {"A=B": "x"}}}})
    done = subprocess.run([sys.executable, "-m", "tether", "mcp-proxy", "--config",
                           str(config), "--journal", f"sqlite:///{tmp_path / 'j.db'}"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: cannot start upstream a") and \
        len(done.stderr.strip().splitlines()) == 1, done.stderr


async def test_a_probe_modules_unclosed_file_is_flushed_when_the_proxy_exits(
        bank_env: Path, tmp_path: Path) -> None:
    """Without user code the proxy's exit skips tearing down the SDK's objects (a frozen
    collector); a probe is user code, whose module-level file only its finalizer flushes."""
    out = tmp_path / "probe.log"
    (tmp_path / "noting.py").write_text(
        f"log = open({str(out)!r}, 'w')\nlog.write('imported')\n\n\n"
        "async def pay(account: str, cents: int, *, idempotency_key: str) -> None:\n"
        "    log.write(account)\n")
    config = write(tmp_path, {"mcpServers": {
        "bank": bank_entry(effects={"pay": "external"}, probes={"pay": "noting:pay"})}})
    async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--config", str(config),
                       "--journal", f"sqlite:///{tmp_path / 'journal.db'}") as session:
        assert "pay" in {t.name for t in (await session.list_tools()).tools}
    assert out.read_text() == "imported"


async def test_user_code_on_the_import_path_keeps_its_unflushed_writes(
        bank_env: Path, tmp_path: Path) -> None:
    """No probe, but a ``sitecustomize`` on the proxy's PYTHONPATH (user code Python imports
    at start-up) with a module-level file, reachable from a function: its last write is
    flushed at exit, as without tether."""
    out = tmp_path / "site.log"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        f"log = open({str(out)!r}, 'w')\nlog.write('started')\n\n\n"
        "def note(what: str) -> None:\n    log.write(what)\n")
    config = write(tmp_path, {"mcpServers": {"bank": bank_entry()}})
    async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--config", str(config),
                       "--journal", f"sqlite:///{tmp_path / 'journal.db'}",
                       env={"PYTHONPATH": os.pathsep.join((str(tmp_path / "site"),
                                                           PYTHONPATH))}) as session:
        assert "pay" in {t.name for t in (await session.list_tools()).tools}
    assert out.read_text() == "started"
