"""Bad input gets a clear error and changes nothing (I7 and the issue's list)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import tether
from tether.errors import (
    BadSignature,
    IdempotencyConflict,
    JournalError,
    Malformed,
    NotFound,
    StaleSequence,
    UnknownKey,
)
from tether.protocol import ControlIntent, ControlKind, Signed, SigningKey
from tether.testing import PaymentService, VirtualClock

from .conftest import Shop

A = tether.ActionState


async def run_child(sup: tether.Supervisor, fn: Any, tools: list[Any]) -> tether.Handle:
    child = await sup.delegate(fn, tools=tools)
    await child.wait()
    return child


async def failure_of(child: tether.Handle) -> BaseException:
    with pytest.raises(tether.DelegationError) as info:
        await child.result()
    cause = info.value.__cause__
    assert cause is not None
    return cause


async def test_tool_outside_the_surface_is_refused_and_not_journaled(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService) -> None:
    async def agent(ctx: tether.Context) -> None:
        await ctx.call(shop.refund, order_id="X", cents=1)

    child = await run_child(sup, agent, [shop.get_order])
    err = await failure_of(child)
    assert isinstance(err, tether.errors.UserError) and "not in the surface" in str(err)
    assert (await child.report()).actions == () and pay.requests == 0


async def test_an_undeclared_function_is_not_a_tool(sup: tether.Supervisor) -> None:
    async def plain(**_: Any) -> None:
        return None

    async def agent(ctx: tether.Context) -> None:
        await ctx.call(plain)  # type: ignore[arg-type]

    err = await failure_of(await run_child(sup, agent, []))
    assert isinstance(err, tether.errors.UserError) and "@tether.tool" in str(err)
    with pytest.raises(tether.errors.UserError, match="not a tether tool"):
        await sup.delegate(agent, tools=[plain])  # type: ignore[list-item]


async def test_an_unknown_tool_name_is_refused(sup: tether.Supervisor, shop: Shop) -> None:
    async def agent(ctx: tether.Context) -> None:
        await ctx.call("transfer_all_funds")

    err = await failure_of(await run_child(sup, agent, shop.tools))
    assert isinstance(err, tether.errors.UserError) and "transfer_all_funds" in str(err)


async def test_arguments_that_cannot_be_serialized(sup: tether.Supervisor, shop: Shop,
                                                   pay: PaymentService) -> None:
    async def agent(ctx: tether.Context) -> None:
        await ctx.call(shop.refund, order_id=object(), cents=1)

    child = await run_child(sup, agent, shop.tools)
    err = await failure_of(child)
    assert isinstance(err, tether.errors.UserError) and "cannot be serialized" in str(err)
    assert (await child.report()).actions == () and pay.requests == 0


async def test_delegation_arguments_that_cannot_be_serialized(sup: tether.Supervisor,
                                                              shop: Shop) -> None:
    with pytest.raises(tether.errors.UserError, match="cannot be serialized"):
        await sup.delegate(shop.refund_agent, {1, 2}, tools=shop.tools)
    assert await sup.journal.delegations() == []


async def test_reused_key_with_other_arguments_is_an_error(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    async def agent(ctx: tether.Context) -> None:
        await ctx.call(shop.refund, order_id="K-1", cents=100, idempotency_key="refund-K-1")
        await ctx.call(shop.refund, order_id="K-1", cents=999, idempotency_key="refund-K-1")

    child = await sup.delegate(agent, tools=shop.tools)
    await clock.sleeping(1)
    clock.advance(1.0)
    err = await failure_of(child)
    assert isinstance(err, IdempotencyConflict) and err.key == "refund-K-1"
    report = await child.report()
    assert [(a.args["cents"], a.state) for a in report.actions] == [(100, A.COMPLETED)]
    assert pay.refund_count("K-1") == 1


async def test_reused_key_with_the_same_arguments_replays(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    async def agent(ctx: tether.Context) -> list[str]:
        return [await ctx.call(shop.refund, order_id="K-2", cents=5, idempotency_key="k2")
                for _ in range(3)]

    child = await sup.delegate(agent, tools=shop.tools)
    await clock.sleeping(1)
    clock.advance(1.0)
    refs = await child.result()
    assert len(set(refs)) == 1 and pay.requests == 1
    assert len((await child.report()).actions) == 1


@pytest.mark.parametrize("key", ["", 7])
async def test_bad_explicit_key(sup: tether.Supervisor, shop: Shop, key: Any) -> None:
    async def agent(ctx: tether.Context) -> None:
        await ctx.call(shop.refund, order_id="K-3", cents=5, idempotency_key=key)

    err = await failure_of(await run_child(sup, agent, shop.tools))
    assert isinstance(err, tether.errors.UserError) and "idempotency_key" in str(err)


def test_tool_declarations_are_checked() -> None:
    def sync_tool(*, idempotency_key: str) -> None:
        return None

    async def no_key(x: int) -> None:
        return None

    with pytest.raises(tether.errors.UserError, match="async"):
        tether.tool(sync_tool)  # type: ignore[arg-type]
    with pytest.raises(tether.errors.UserError, match="idempotency_key"):
        tether.tool(no_key)  # EXTERNAL by default, so it must take a key
    assert tether.tool(effect=tether.Effect.READ_ONLY)(no_key).effect is tether.Effect.READ_ONLY
    with pytest.raises(tether.errors.UserError, match="DELEGATE"):
        tether.tool(effect=tether.Effect.DELEGATE)(no_key)
    with pytest.raises(tether.errors.UserError, match="effect"):
        tether.tool(effect="EXTERNAL")(no_key)  # type: ignore[call-overload]


async def test_control_misuse_changes_nothing(sup: tether.Supervisor, shop: Shop) -> None:
    shop.gate = asyncio.Event()
    child = await sup.delegate(shop.refund_agent, "M-1", tools=shop.tools)
    for grace in (0, -1.0, float("nan"), float("inf"), sup.policy.max_grace + 1):
        with pytest.raises(tether.errors.UserError, match="grace"):
            await child.recall(grace=grace)
    with pytest.raises(StaleSequence) as info:
        await child.recall(grace=1.0, seq=5)
    assert info.value.current == 0
    with pytest.raises(Malformed, match="seq"):
        await child.terminate(seq=0)
    row = await sup.journal.get(child.id)
    assert (row.state, row.fenced, row.control_seq) == (tether.DelegationState.RUNNING, False, 0)
    assert await sup.journal.controls(child.id) == []
    with pytest.raises(NotFound):
        await sup.handle_for("d_missing").recall(grace=1.0)
    shop.gate.set()


async def test_a_forged_intent_is_refused_by_the_journal(sup: tether.Supervisor,
                                                         shop: Shop) -> None:
    shop.gate = asyncio.Event()
    child = await sup.delegate(shop.refund_agent, "M-2", tools=shop.tools)
    stranger = SigningKey.generate()
    intent = ControlIntent(ControlKind.TERMINATE, child.id, 0, 1, None, "x", 0.0)
    with pytest.raises(UnknownKey):
        await sup.journal.accept_control(stranger.sign(intent), sup.keys.trusted, "x", 0.0)
    good = sup.keys.signer.sign(intent)
    with pytest.raises(BadSignature):
        await sup.journal.accept_control(
            Signed(good.body.replace(b'"x"', b'"y"'), good.key_id, good.signature),
            sup.keys.trusted, "x", 0.0)
    assert (await sup.journal.get(child.id)).control_seq == 0
    shop.gate.set()


async def test_task_ids_cannot_be_reused(sup: tether.Supervisor, shop: Shop) -> None:
    shop.gate = asyncio.Event()
    await sup.delegate(shop.refund_agent, "M-3", tools=shop.tools, task_id="refund-M-3")
    with pytest.raises(tether.errors.UserError, match="re-delegate"):
        await sup.delegate(shop.refund_agent, "M-3", tools=shop.tools, task_id="refund-M-3")
    assert len(await sup.journal.delegations()) == 1
    shop.gate.set()


async def test_a_closed_supervisor_refuses_work(journal_url: str, shop: Shop) -> None:
    sup = tether.Supervisor(journal_url, keys=tether.KeyRing.ephemeral())
    with pytest.raises(tether.errors.UserError, match="not open"):
        await sup.delegate(shop.refund_agent, "M-4", tools=shop.tools)


async def test_tool_failure_modes(sup: tether.Supervisor, pay: PaymentService,
                                  clock: VirtualClock) -> None:
    """ToolRejected proves nothing applied (FAILED); any other error may have applied, so the
    action is IN_DOUBT and probed once the child ends."""

    @tether.tool(probe=pay.lookup)
    async def declined(order_id: str, cents: int, *, idempotency_key: str) -> str:
        raise tether.ToolRejected("card declined")

    @tether.tool(probe=pay.lookup)
    async def flaky(order_id: str, cents: int, *, idempotency_key: str) -> str:
        await pay.refund(order_id, cents, idempotency_key=idempotency_key)
        raise ConnectionResetError("reply lost")

    async def agent(ctx: tether.Context) -> None:
        with pytest.raises(tether.ToolRejected):
            await ctx.call(declined, order_id="F-1", cents=1)
        await ctx.call(flaky, order_id="F-1", cents=2)

    child = await sup.delegate(agent, tools=[declined, flaky])
    await clock.sleeping(1)
    clock.advance(1.0)
    err = await failure_of(child)
    assert isinstance(err, ConnectionResetError)
    report = await child.report()
    assert [(a.tool, a.state) for a in report.actions] == [("declined", A.FAILED),
                                                            ("flaky", A.COMPLETED)]
    assert report.actions[1].evidence is not None
    assert report.outcome is tether.DelegationState.RECONCILED


async def test_concurrent_calls_of_one_tool_get_distinct_keys(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    async def agent(ctx: tether.Context) -> list[str]:
        return list(await asyncio.gather(
            *(ctx.call(shop.refund, order_id=f"G-{i}", cents=i) for i in range(4))))

    child = await sup.delegate(agent, tools=shop.tools)
    await clock.sleeping(4)
    clock.advance(1.0)
    assert len(set(await child.result())) == 4
    keys = [a.idempotency_key for a in (await child.report()).actions]
    assert len(set(keys)) == 4 and pay.requests == 4


# -- journals that cannot be opened: one `error:` line, exit 2, nothing changed ---------------

def cli(*args: str, prelude: str = "", timeout: float = 60.0) -> tuple[int, str, str]:
    """Run the CLI in a process of its own (a mistake that hangs fails the test, never the run);
    ``prelude``: Python run first, to change that process's world."""
    code = f"{prelude}\nimport sys\nfrom tether._cli.app import main\nsys.argv = ['tether', " \
           f"*{list(args)!r}]\nmain()\n"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, cwd=Path(__file__).parent.parent)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tether {' '.join(args)} still running after {timeout}s")
    return done.returncode, done.stdout, done.stderr


def one_error_line(args: tuple[str, ...], prelude: str = "") -> str:
    code, out, err = cli(*args, prelude=prelude)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (code, err)
    assert "Traceback" not in out + err
    return lines[0]


async def test_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "journal.db"
    os.mkfifo(fifo)
    assert "FIFO" in one_error_line(("ls", "--journal", f"sqlite:///{fifo}"))
    opening = tether.Supervisor(f"sqlite:///{fifo}", keys=tether.KeyRing.ephemeral())
    with pytest.raises(JournalError, match="FIFO"):
        await asyncio.wait_for(opening.__aenter__(), 30)
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    line = one_error_line(("ls", "--journal", f"sqlite:///{tmp_path / 'dir'}"))
    assert "is a directory" in line
    assert list((tmp_path / "dir").iterdir()) == []


def test_an_unknown_postgresql_url_parameter_is_named(tmp_path: Path) -> None:
    url = "postgresql://postgres@127.0.0.1:5432/test?schema=never_made&bogus=1"
    assert "bogus" in one_error_line(("ls", "--journal", url))


BLOCK_PSYCOPG = """
import sys
class NoPsycopg:  # as if tether had been installed without its [postgres] extra
    def find_spec(self, name, path=None, target=None):
        if name == "psycopg" or name.startswith(("psycopg.", "psycopg_")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoPsycopg())
"""


def test_postgresql_without_its_extra_says_what_to_install() -> None:
    url = "postgresql://postgres@127.0.0.1:5432/test?schema=never_made"
    line = one_error_line(("ls", "--journal", url), prelude=BLOCK_PSYCOPG)
    assert "tether[postgres]" in line


async def test_a_journal_path_under_a_file_is_a_tether_error(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    with pytest.raises(JournalError, match="cannot"):
        async with tether.Supervisor(f"sqlite:///{tmp_path / 'plain' / 'journal.db'}",
                                     keys=tether.KeyRing.ephemeral()):
            pass
    assert (tmp_path / "plain").read_text() == "x"


# Root writes anywhere: the process drops the capability that lets it, as an ordinary user's
# process never had it; then a directory without write permission is what a user sees.
DROP_ROOT_WRITES = """
import ctypes, os
if os.geteuid() == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    assert libc.capget(hdr, data) == 0
    for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
        data[0] &= ~(1 << cap); data[1] &= ~(1 << cap)
    assert libc.capset(hdr, data) == 0, ctypes.get_errno()
"""

OPEN_SUPERVISOR = """
import asyncio, sys, tether
async def main():
    async with tether.Supervisor(sys.argv[1], keys=tether.KeyRing.ephemeral()):
        pass
try:
    asyncio.run(main())
except tether.TetherError as exc:
    print(type(exc).__name__, exc)
"""


def test_a_supervisor_on_an_unwritable_directory_raises_a_tether_error(
        tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        done = subprocess.run(
            [sys.executable, "-c", DROP_ROOT_WRITES + OPEN_SUPERVISOR,
             f"sqlite:///{locked / 'journal.db'}"], capture_output=True, text=True, timeout=60)
    finally:
        locked.chmod(0o755)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith("JournalError cannot open the journal"), done.stdout
    assert list(locked.iterdir()) == []


async def test_a_model_that_is_not_a_name_is_a_user_error(sup: tether.Supervisor,
                                                          shop: Shop) -> None:
    with pytest.raises(tether.errors.UserError, match="model must be a string"):
        await sup.delegate(shop.refund_agent, "M-9", tools=shop.tools,
                           model=object())  # type: ignore[arg-type]
    assert await sup.journal.delegations() == []


@pytest.mark.parametrize(("url", "says"), [
    ("postgresql://[bad/db", "not understood"),
    ("sqlite:///journal.db?bogus=1", "unknown parameter 'bogus'"),
    ("sqlite:///journal.db?schema=x", "unknown parameter 'schema'"),
])
def test_a_malformed_journal_url_is_one_error_line(url: str, says: str) -> None:
    assert says in one_error_line(("ls", "--journal", url))
    with pytest.raises(tether.errors.UserError, match=says):
        tether.Journal(url)


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"journal": 123}, "journal must be"),
    ({"journal": None}, "journal must be"),
    ({"clock": object()}, "clock must"),
    ({"keys": "keys/"}, "keys must be a tether.KeyRing"),
    ({"policy": {"max_grace": 5}}, "policy must be a tether.Policy"),
    ({"redispatch": 1}, "redispatch must be"),
    ({"tools": "refund"}, "tools must be a list"),
    ({"tools": object()}, "tools must be a list"),
], ids=["journal-int", "journal-none", "clock", "keys", "policy", "redispatch", "tools-str",
        "tools-object"])
def test_supervisor_arguments_of_the_wrong_kind_are_named(kwargs: dict[str, Any], says: str,
                                                          tmp_path: Path) -> None:
    kwargs = {"journal": f"sqlite:///{tmp_path / 'j.db'}", **kwargs}
    with pytest.raises(tether.errors.UserError, match=says):
        tether.Supervisor(**kwargs)
    assert not (tmp_path / "j.db").exists()


def invoke(*args: str) -> tuple[int, str, str]:
    """The CLI in this process (typer's runner): for mistakes that cannot hang."""
    from typer.testing import CliRunner

    from tether._cli.app import app

    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def one_line(*args: str) -> str:
    code, out, err = invoke(*args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (code, out, err)
    return lines[0]


@pytest.mark.parametrize("value", ["1e400", "nan", "-1", "inf", "1e12"])
def test_a_busy_timeout_out_of_range_is_one_error_line(tmp_path: Path, value: str) -> None:
    for existing in (False, True):
        if existing:
            asyncio.run(made(f"sqlite:///{tmp_path / 'j.db'}"))
        url = f"sqlite:///{tmp_path / 'j.db'}?busy_timeout={value}"
        assert "must be between 0 and 86400 seconds" in one_line("ls", "--journal", url)
        assert (tmp_path / "j.db").exists() is existing


@pytest.mark.parametrize(("query", "said"), [
    ("busy_timeout=", "'busy_timeout' has no value"),
    ("busy_timeout=1&busy_timeout=2", "'busy_timeout' is given twice"),
    ("keys=k%00x", "NUL"),
])
def test_an_empty_repeated_or_nul_url_parameter_is_one_error_line(
        tmp_path: Path, query: str, said: str) -> None:
    """Found by review: an empty busy_timeout fell back to 5 s, a repeated one took the first,
    and a NUL byte in the key directory read as 'not trusted'. Each is the user's mistake."""
    url = f"sqlite:///{tmp_path / 'j.db'}?{query}"
    assert said in one_line("ls", "--journal", url)
    assert not (tmp_path / "j.db").exists()


async def made(url: str) -> None:
    """A journal with one delegation that ended (old enough for ``prune --before 0s``)."""
    async def agent(ctx: tether.Context) -> str:
        return "ok"

    async with tether.Supervisor(url) as sup:
        await (await sup.delegate(agent)).result()


def test_export_to_a_path_that_cannot_be_written_is_one_error_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(made(url))
    line = one_line("export", "-o", "/proc/nope/x", "--journal", url)
    assert "cannot write /proc/nope/x" in line
    line = one_line("export", "-o", str(tmp_path), "--journal", url)  # a directory
    assert "cannot write" in line
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_export_that_fails_leaves_no_file(tmp_path: Path) -> None:
    target = tmp_path / "out.jsonl"
    line = one_line("export", "-o", str(target), "--journal",
                    f"sqlite:///{tmp_path / 'missing.db'}")
    assert "no journal" in line
    assert list(tmp_path.iterdir()) == []  # neither the output nor a part of it


def test_prune_to_an_archive_that_cannot_be_written_is_one_error_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(made(url))
    line = one_line("prune", "--before", "0s", "--archive", "/proc/nope/x", "--journal", url)
    assert "cannot write the archive /proc/nope/x" in line
    (tmp_path / "kept.jsonl").write_text("earlier archive\n")
    line = one_line("prune", "--before", "0s", "--archive", str(tmp_path / "kept.jsonl"),
                    "--journal", url)
    assert "exists" in line and (tmp_path / "kept.jsonl").read_text() == "earlier archive\n"
    code, out, _ = invoke("ls", "--journal", url, "--json")
    assert code == 0 and len(json.loads(out)) == 1  # nothing was pruned


def test_a_new_journal_and_its_folder_are_private(tmp_path: Path) -> None:
    folder = tmp_path / "a" / "b"
    asyncio.run(made(f"sqlite:///{folder / 'j.db'}"))
    for made_dir in (tmp_path / "a", folder):
        assert stat.S_IMODE(made_dir.stat().st_mode) == 0o700, made_dir
    assert stat.S_IMODE((folder / "j.db").stat().st_mode) == 0o600


def test_export_never_writes_over_the_journal_and_writes_into_a_device(tmp_path: Path) -> None:
    """An export aimed at the journal (or its log) is refused; one aimed at a device or a
    pipe is written into it, never swapped for a regular file."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(made(url))
    before = (tmp_path / "j.db").read_bytes()
    for target in ("j.db", "j.db-wal", "link.db"):
        if target == "link.db":
            (tmp_path / "link.db").symlink_to(tmp_path / "j.db")
        assert "refusing to write over it" in one_line(
            "export", "-o", str(tmp_path / target), "--journal", url)
    assert (tmp_path / "j.db").read_bytes() == before
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(pipe.read_bytes()))
    reader.start()
    code, _, err = invoke("export", "-o", str(pipe), "--journal", url)
    reader.join(30)
    assert code == 0, err
    assert stat.S_ISFIFO(pipe.stat().st_mode) and b'"delegation"' in got[0]


def test_an_archive_is_private(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(made(url))
    archive = tmp_path / "pruned.jsonl"
    code, out, err = invoke("prune", "--before", "0s", "--archive", str(archive), "--journal", url)
    assert code == 0, (out, err)
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600


def test_a_journal_url_with_a_nul_byte_is_one_error_line(tmp_path: Path) -> None:
    assert "NUL byte" in one_line("ls", "--journal", f"sqlite:///{tmp_path}/j%00.db")
