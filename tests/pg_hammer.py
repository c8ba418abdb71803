"""A process that hammers one delegation in a PostgreSQL journal (run by test_postgres.py).

    python -m tests.pg_hammer URL ROLE DELEGATION N
ROLE "act": start actions until the fence refuses one; prints how many it started.
ROLE "fence": once N actions exist, accept a RECALL, then print the action count it saw right
after its fence committed.
ROLE "control": try sequence numbers 1..N; prints the ones this process won.
ROLE "redelegate": try to move the task from epochs 0..N-1; prints the epochs this process won.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys

import tether
from tether._journal.journal import Journal
from tether._journal.rows import Begin, NewAction, NewDelegation
from tether.errors import ControlRefused, StaleEpoch
from tether.protocol import ControlIntent, ControlKind, SigningKey, TrustedKeys

KEY = SigningKey.from_raw(bytes(range(32)))  # shared by the processes of one test
TRUSTED = TrustedKeys([KEY.public])


async def main(url: str, role: str, delegation: str, n: int) -> None:
    async with Journal(url, create=False) as j:
        await j.genesis(KEY, 0.0)  # KEY roots the key registry (the first process records it)
        me = os.getpid()
        if role == "act":
            started = 0
            while True:
                args = f'{{"p":{me},"i":{started}}}'
                result = await j.begin_action(NewAction(
                    f"a{me}-{started}", delegation, 0, started, "pay", tether.Effect.EXTERNAL,
                    args, hashlib.sha256(args.encode()).hexdigest(), f"k{me}-{started}", 1.0, 31.0))
                if result.status is not Begin.STARTED:
                    break
                started += 1
            print(started)
        elif role == "fence":
            count = 0
            while count < n:  # the other processes' progress, read from the journal itself
                count = len(await j.actions([delegation]))
            intent = ControlIntent(ControlKind.RECALL, delegation, 0, 1, 5.0,
                                          "hammer", 2.0)
            await j.accept_control(KEY.sign(intent), TRUSTED, "fencer", 2.0)
            print(len(await j.actions([delegation])))
        elif role == "control":
            won = []
            for seq in range(1, n + 1):
                row = await j.get(delegation)
                kind = ControlKind.RECALL if seq == 1 else ControlKind.TERMINATE
                intent = ControlIntent(kind, delegation, row.epoch, seq,
                                              5.0 if seq == 1 else None, f"p{me}", 2.0)
                try:
                    await j.accept_control(KEY.sign(intent), TRUSTED, f"p{me}", 2.0)
                    won.append(seq)
                except ControlRefused:
                    pass
            print(" ".join(map(str, won)))
        elif role == "redelegate":
            won = []
            row = await j.get(delegation)
            for epoch in range(n):
                try:
                    await j.create_delegation(NewDelegation(
                        f"r{me}-{epoch}", row.task_id, None, 1, "a", (), {}, "o", 3.0,
                        redelegate_from_epoch=epoch))
                    won.append(epoch)
                except StaleEpoch:
                    pass
            print(" ".join(map(str, won)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
