"""A revocation sticks in every running process of the configuration that made or read it.

What each process remembers (docs/security.md): its configuration's ``registry.json`` (beside
its keys) holds, per journal, how long the key registry was and which keys were seen revoked.
A process reads that file again whenever it decides trust and it has changed, so a revocation
made by another process of the same configuration (``tether keys revoke`` in another shell)
binds a supervisor that was already running; deleting the revocation row then reads as a
rollback, and the key stays revoked. A configuration that never saw the revocation (the
revoked key's own folder) cannot know it: the journal may accept that key's intent, but no
process of a configuration that saw the revocation acts on it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import tether
from tether._core.model import ControlKind
from tether._runtime.control import ControlRequest, send_control

from .test_trust import raw


async def test_a_running_supervisor_never_acts_for_a_key_another_process_revoked(
        journal_url: str, tmp_path: Path) -> None:
    deployment = tether.KeyRing.init(tmp_path / "deployment")
    leaked = tether.KeyRing.init(tmp_path / "leaked")
    leaked.pin(deployment.signer.key_id, deployment.signer.public_b64())
    gate = asyncio.Event()

    async def waits(ctx: tether.Context) -> str:
        await gate.wait()
        return "done"

    async with tether.Supervisor(journal_url, keys=deployment) as sup:
        await sup.journal.change_trust(deployment.signer, deployment.trusted, "trust",
                                       leaked.signer.key_id, leaked.signer.public_b64(),
                                       "contractor", time.time())
        await sup.current_trust()  # this process has read the grant
        child = await sup.delegate(waits)
        # Another process of the deployment's configuration revokes the key...
        other = tether.KeyRing.load(tmp_path / "deployment")
        async with tether.Journal(journal_url) as j:
            await j.change_trust(other.signer, other.trusted, "revoke",
                                 leaked.signer.key_id, "", "", time.time())
        # ...and an intruder with write access deletes the revocation.
        await raw(sup.journal, "DELETE FROM trust WHERE op = 'revoke'")
        # The revoked key's holder recalls, from a configuration that never saw the revocation:
        # its own view of the registry trusts it, so the journal takes the intent.
        await send_control(ControlRequest(journal_url, tmp_path / "leaked", child.id,
                                          ControlKind.RECALL, 5.0, "leaked key", "mallory"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not any(e.kind == "control_refused"
                      for e in await sup.journal.events([child.id])):
            assert loop.time() < deadline, "the supervisor never judged the intent"
            await asyncio.sleep(0.02)
        gate.set()
        assert await child.result() == "done"  # not recalled: it ran to its end
        # The row shows what the journal took (denial of service, as any untrusted intent);
        # the owner did not drain for it.
        report = await child.report()
        assert report.outcome is not tether.DelegationState.RECALLED and report.actions == ()
        reg = await sup.journal.registry(deployment.trusted)
        assert leaked.signer.key_id not in reg.keys
        assert any("rolled back" in p for p in reg.problems), reg.problems
