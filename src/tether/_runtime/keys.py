"""Key files: the operator's signing key and the set of keys a journal trusts.

Layout of a key directory (default: ``keys/`` beside the journal file):
``signing.json`` holds the private key (mode 0600); ``trusted.json`` maps key ids to public keys.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tether._core.errors import ControlRefused, UserError
from tether._core.signing import SigningKey, TrustedKeys


@dataclass
class KeyRing:
    signer: SigningKey
    trusted: TrustedKeys
    directory: Path | None = None

    @classmethod
    def ephemeral(cls) -> KeyRing:
        """A fresh key trusted only by this ring: for tests and one-process use."""
        signer = SigningKey.generate("ephemeral")
        return cls(signer, TrustedKeys([signer.public]))

    @classmethod
    def load(cls, directory: Path) -> KeyRing:
        signing, trusted = directory / "signing.json", directory / "trusted.json"
        if not signing.exists():
            raise UserError(f"no signing key in {directory}; run 'tether keys init'")
        try:
            data = json.loads(signing.read_text())
            signer = SigningKey.from_raw(bytes.fromhex(data["private"]), data.get("label", ""))
            if signer.key_id != data["key_id"]:
                raise ValueError("key id does not match the key")
            keys = TrustedKeys.from_b64(json.loads(trusted.read_text()))
        except (OSError, ValueError, KeyError, TypeError, ControlRefused) as exc:
            raise UserError(f"key files in {directory} are unreadable: {exc}") from None
        return cls(signer, keys, directory)

    @classmethod
    def init(cls, directory: Path, label: str = "operator") -> KeyRing:
        """Create a signing key and trust it. Refuses to overwrite an existing key."""
        signing, trusted = directory / "signing.json", directory / "trusted.json"
        if signing.exists():
            raise UserError(f"{signing} already exists; refusing to replace a signing key")
        directory.mkdir(parents=True, exist_ok=True)
        signer = SigningKey.generate(label)
        fd = os.open(signing, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"key_id": signer.key_id, "label": label, "private": signer.raw().hex()}, fh)
        existing: dict[str, str] = {}
        if trusted.exists():
            existing = json.loads(trusted.read_text())
        existing[signer.key_id] = signer.public_b64()
        trusted.write_text(json.dumps(existing, indent=2, sort_keys=True))
        return cls(signer, TrustedKeys.from_b64(existing), directory)

    @classmethod
    def load_or_init(cls, directory: Path) -> KeyRing:
        if (directory / "signing.json").exists():
            return cls.load(directory)
        return cls.init(directory)
