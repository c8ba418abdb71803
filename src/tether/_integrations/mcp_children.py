"""The proxy's stdio upstreams as child processes, each the leader of a process group of its
own, stopped with the proxy however the proxy ends: its client's EOF, or a signal.

A client that is done closes the proxy's stdin, waits a moment, then sends SIGTERM (the
TypeScript SDK's stdio client after 2 s; its version probe at once, then SIGKILL 1 s later).
A proxy killed by that signal would leave its upstreams running, holding the stderr it gave
them, which is the client's: a client waiting for that pipe to close then hangs. So, on EOF,
each upstream's stdin is closed (the MCP shutdown sequence), and a group still there after
``GRACE`` gets SIGTERM, then SIGKILL after ``FORCE``; on SIGTERM, SIGHUP or SIGINT every group
gets SIGTERM at once (a second signal: SIGKILL), what the proxy was serving is cancelled, and
the proxy exits with ``128 + signal`` once its session's delegation is settled. Whatever is
left of a group after its leader exits (a server's own children) is stopped too. SIGKILL of
the proxy itself cannot be caught: its upstreams then see their stdin close.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tether._core.errors import UserError
from tether._integrations.mcp_config import ProxyConfig, UpstreamSpec
from tether._integrations.mcp_stdio import LINE_LIMIT

GRACE = 2.0  # seconds an upstream has to exit after its stdin closes (the SDKs' own)
FORCE = 2.0  # seconds after SIGTERM before SIGKILL
HURRIED = 0.5  # the same, once a signal stops the proxy: its client may SIGKILL it soon
EXIT_WITHIN = 10.0  # seconds a signalled proxy's exit may take, signals ignored meanwhile
POLL = 0.01
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
# What a server from a config file inherits of the proxy's environment, beside its own
# ``env``: the MCP SDK's default (``mcp.client.stdio.get_default_environment``, which a test
# holds this to), read here so that upstreams start before that SDK is imported.
INHERITED = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER")


class Children:
    """The proxy's upstream process groups; ``stop_now`` signals every one of them."""

    def __init__(self) -> None:
        self.groups: set[int] = set()
        self.hurried = asyncio.Event()
        self._kills = 0

    def stop_now(self) -> None:
        """SIGTERM every group at once; called again, SIGKILL."""
        self._kills += 1
        self.hurried.set()
        for group in list(self.groups):
            _signal_group(group, signal.SIGTERM if self._kills == 1 else signal.SIGKILL)


def _signal_group(group: int, sig: signal.Signals) -> bool:
    """Whether any process of the group was there to be signalled."""
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that is not ours: the group is still there
        return True
    return True


async def _until(done: Any, within: float, hurry: asyncio.Event | None = None) -> bool:
    """Polls ``done()`` for up to ``within`` seconds (cut short by ``hurry``)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + within
    while not done():
        if loop.time() >= give_up or (hurry is not None and hurry.is_set()):
            return False
        await asyncio.sleep(POLL)
    return True


async def stop(proc: asyncio.subprocess.Process, children: Children) -> None:
    """Stdin closed, the grace to exit, then SIGTERM to the group, and SIGKILL for whatever
    of it outlived its leader or the time to stop. Every wait is bounded, and is for the
    leader: the returncode is polled (``wait()`` also waits for the pipes, which a surviving
    child of the server may hold), and members of the group that exited may stay as zombies
    of an init that does not reap them, so the group's own presence proves nothing."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    exited = await _until(lambda: proc.returncode is not None, GRACE, children.hurried)
    group = proc.pid
    if _signal_group(group, signal.SIGTERM) and not exited:
        force = HURRIED if children.hurried.is_set() else FORCE
        await _until(lambda: proc.returncode is not None, force)
    if _signal_group(group, signal.SIGKILL) and proc.returncode is None:
        await _until(lambda: proc.returncode is not None, FORCE)


async def stop_surely(proc: asyncio.subprocess.Process, children: Children) -> None:
    """``stop``, carried to its end even if the task is cancelled meanwhile (every wait in it
    is bounded): a cancel that lands while the proxy unwinds would otherwise leave the
    upstream running, holding its client's stderr. The cancel is raised once it is done."""
    stopping = asyncio.ensure_future(stop(proc, children))
    cancelled = False
    while not stopping.done():
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    stopping.result()


def environment(spec: UpstreamSpec) -> dict[str, str]:
    """An ``--upstream``'s: the proxy's own, as a shell command's; a config file's server's:
    the SDK's default (no shell functions) plus its own ``env``."""
    if spec.env is None:
        return dict(os.environ)
    inherited = {k: v for k in INHERITED
                 if (v := os.environ.get(k)) is not None and not v.startswith("()")}
    return {**inherited, **spec.env}


async def spawn(spec: UpstreamSpec, children: Children) -> asyncio.subprocess.Process:
    """Start a stdio upstream, the leader of a process group of its own; one that cannot
    start is one line."""
    try:
        proc = await asyncio.create_subprocess_exec(
            spec.command[0], *spec.command[1:], stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=environment(spec), cwd=spec.cwd,
            start_new_session=True, limit=LINE_LIMIT)
    except (OSError, ValueError) as exc:  # ValueError: a bad env name, a NUL byte
        raise UserError(f"cannot start upstream {spec.name} ({spec.command[0]}): {exc}") \
            from None
    children.groups.add(proc.pid)
    if children.hurried.is_set():  # the proxy is already stopping
        _signal_group(proc.pid, signal.SIGTERM)
    return proc


async def spawn_all(upstreams: Mapping[str, UpstreamSpec],
                    children: Children) -> dict[str, asyncio.subprocess.Process]:
    """Every stdio upstream started; if one cannot start, those started before are stopped."""
    started: dict[str, asyncio.subprocess.Process] = {}
    try:
        for name, spec in upstreams.items():
            if spec.url is None:
                started[name] = await spawn(spec, children)
    except BaseException:
        await stop_all(started, children)
        raise
    return started


async def stop_all(started: dict[str, asyncio.subprocess.Process], children: Children) -> None:
    """Stop, and forget, what ``spawn_all`` started that nobody took."""
    procs = list(started.values())
    started.clear()
    await asyncio.gather(*(stop_surely(proc, children) for proc in procs))


class Stopper:
    """SIGTERM, SIGHUP and SIGINT for the proxy: its upstream groups signalled at once, and
    the task serving its client cancelled while it serves (a session that already ended is
    left to settle, hurried). ``exit_code`` is then ``128 + signal``."""

    def __init__(self, children: Children) -> None:
        self.children = children
        self.signal: int | None = None
        self._serving: asyncio.Task[Any] | None = None
        self._then: list[Callable[[], None]] = []

    def install(self) -> None:
        """For the rest of the event loop's life: its close removes them. Not sooner, since
        ``asyncio.run`` then waits for the SDK's import thread (up to a second), and a second
        signal meanwhile would take its default action: the proxy killed, not exiting."""
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._received, sig)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """A signal while inside cancels the current task."""
        self._serving = asyncio.current_task()
        if self.signal is not None:
            self._serving.cancel()  # type: ignore[union-attr]
        try:
            yield
        finally:
            self._serving = None

    def then(self, hook: Callable[[], None]) -> None:
        """Also call ``hook`` at each signal from now on (a server to stop, say)."""
        self._then.append(hook)

    def _received(self, signum: int) -> None:
        self.children.stop_now()
        for hook in self._then:
            hook()
        if self.signal is None:
            self.signal = signum
            if self._serving is not None and not self._serving.done():
                self._serving.cancel(f"tether mcp-proxy: signal {signum}")

    @property
    def exit_code(self) -> int | None:
        return None if self.signal is None else 128 + self.signal

    def exit(self) -> None:
        """Exit with ``128 + signal`` if a signal stopped the proxy (its upstreams stopped).
        Signals are ignored from here on: the loop's close would give them back their
        default action, and a second one in the interpreter's teardown (tens of ms) killed
        the proxy instead (-15, not 143)."""
        if self.signal is None:
            return
        loop = asyncio.get_running_loop()
        # Taken off the loop (its close then leaves them alone), then ignored, with the
        # signals held meanwhile: between the two, the default action (for SIGINT, a
        # KeyboardInterrupt) would otherwise stand.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        # No signal can end it now, so its exit is bounded here: past every bound of its own
        # teardown (upstreams, journal, server), an atexit hook that hangs (a telemetry flush
        # to a collector that is gone) must not keep it for ever.
        last = threading.Timer(EXIT_WITHIN, os._exit, (128 + self.signal,))
        last.daemon = True
        last.start()
        raise SystemExit(128 + self.signal)


async def run_stdio(journal: str, config: ProxyConfig) -> None:
    """``tether mcp-proxy`` over stdio, its upstreams started first: they boot while the MCP
    SDK is imported (about 0.7 s, which they no longer wait behind), the proxy's signal
    handlers already installed, so a signal meanwhile stops them too."""
    import importlib

    stopper = Stopper(Children())
    started: dict[str, asyncio.subprocess.Process] = {}
    stopper.install()
    try:
        with stopper.serving():  # a signal before serving begins cancels this
            started.update(await spawn_all(config.upstreams, stopper.children))
            try:
                serve = await asyncio.to_thread(importlib.import_module,
                                                "tether._integrations.mcp_serve")
            except ModuleNotFoundError as exc:  # an SDK present but broken
                raise UserError("tether mcp-proxy needs the MCP SDK: pip install "
                                f"'tether[mcp]' ({exc})") from None
        await serve.serve_started(journal, config, stopper, started)
    except asyncio.CancelledError:
        if stopper.signal is None:
            raise
    finally:
        await stop_all(started, stopper.children)  # those no session took
    stopper.exit()
