"""Weak and non-canonical Ed25519 public keys are refused wherever a key enters (I5).

Under a point of small order (the all-zero encoding, the identity, the other torsion points), a
signature built from known points verifies for a good share of messages with no private key at
all; a non-canonical encoding names the same point under another key id. Neither is trusted:
not by ``tether keys trust`` or ``keys pin``, not from a registry row, not by a verifier."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import sqlite3
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tether
from tether._cli.app import app
from tether._core.documents import KeyGrant
from tether._core.errors import Malformed
from tether._core.signing import Signed, TrustedKeys, public_key

from .operator_world import stuck_payment

P = 2**255 - 19
L = 2**252 + 27742317777372353535851937790883648493

SMALL_ORDER = [bytes.fromhex(h) for h in (
    "0100000000000000000000000000000000000000000000000000000000000000",  # the identity
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",  # order 2
    "0000000000000000000000000000000000000000000000000000000000000000",  # order 4
    "0000000000000000000000000000000000000000000000000000000000000080",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",  # order 8
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",
)]
NON_CANONICAL = [
    (1 + P).to_bytes(32, "little"),  # the identity again, y + p
    (P + 2).to_bytes(32, "little"),  # y >= p: y = 2 under another name
    bytes.fromhex("0100000000000000000000000000000000000000000000000000000000000080"),  # -0
    bytes.fromhex("edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),  # y = p
]
WEAK = SMALL_ORDER + NON_CANONICAL
runner = CliRunner()


def kid(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:16]


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize("raw", WEAK, ids=[r.hex()[:8] + r.hex()[-2:] for r in WEAK])
def test_a_weak_public_key_is_refused_by_the_core(raw: bytes) -> None:
    with pytest.raises(ValueError, match="not an acceptable Ed25519 public key"):
        public_key(raw)
    with pytest.raises(Malformed):
        TrustedKeys.from_b64({kid(raw): b64(raw)})


def test_a_good_public_key_is_accepted() -> None:
    signer = tether.KeyRing.ephemeral().signer
    raw = base64.b64decode(signer.public_b64())
    assert public_key(raw) is not None
    keys = TrustedKeys.from_b64({signer.key_id: signer.public_b64()})
    assert signer.key_id in keys


def test_no_signature_made_without_the_private_key_verifies() -> None:
    """The attack: signatures R || S built from points of small order, with S = 0 or S = 1,
    for 40 messages. Under the zero key, most of them verified; with a good key and the
    strict verifier, none does, and a malleated S (S + L) is refused too."""
    signer = tether.KeyRing.ephemeral().signer
    keys = TrustedKeys.from_b64({signer.key_id: signer.public_b64()})
    for i in range(40):
        body = json.dumps({"type": "control", "n": i, "nonce": os.urandom(8).hex()}).encode()
        for r in SMALL_ORDER:
            for s in (0, 1):
                forged = Signed(body, signer.key_id, r + s.to_bytes(32, "little"))
                with pytest.raises(tether.errors.BadSignature):
                    keys.verify_bytes(forged)
    genuine = signer.sign(KeyGrant("trust", "k" * 16, signer.public_b64(), "x", 1.0))
    keys.verify_bytes(genuine)
    s = int.from_bytes(genuine.signature[32:], "little")
    malleated = genuine.signature[:32] + (s + L).to_bytes(32, "little")
    with pytest.raises(tether.errors.BadSignature):
        keys.verify_bytes(Signed(genuine.body, genuine.key_id, malleated))


@pytest.mark.parametrize("verb", ["trust", "pin"])
def test_keys_trust_and_pin_refuse_a_weak_key_with_one_line(tmp_path: Path, verb: str) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(stuck_payment(url))
    before = runner.invoke(app, ["keys", "registry", "--journal", url, "--json"]).stdout
    for raw in (SMALL_ORDER[2], SMALL_ORDER[0], NON_CANONICAL[0]):
        result = runner.invoke(app, ["keys", verb, b64(raw), "--journal", url])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
        assert "not a base64 Ed25519 public key" in lines[0]
    after = runner.invoke(app, ["keys", "registry", "--journal", url, "--json"]).stdout
    assert after == before  # nothing changed


def test_a_weak_key_in_a_registry_row_is_ignored_and_named(tmp_path: Path) -> None:
    """A grant of the zero key, signed by the genuine root (a journal written before this
    check, or a root tricked into it), trusts nothing; the registry names the entry."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(stuck_payment(url))
    ring = tether.KeyRing.load(tmp_path / "keys")
    zero = SMALL_ORDER[2]
    signed = ring.signer.sign(KeyGrant("trust", kid(zero), b64(zero), "weak", time.time()))
    with sqlite3.connect(tmp_path / "j.db") as db:
        db.execute("INSERT INTO trust (op, key_id, body, signer, signature, recorded_at) "
                   "VALUES (?, ?, ?, ?, ?, ?)",
                   ("trust", kid(zero), signed.body, signed.key_id, signed.signature,
                    time.time()))
    result = runner.invoke(app, ["keys", "registry", "--journal", url, "--json"])
    assert result.exit_code == 0, result.output
    registry = json.loads(result.stdout)
    assert kid(zero) not in registry["trusted"]
    assert any("small order" in p for p in registry["problems"]), registry["problems"]
