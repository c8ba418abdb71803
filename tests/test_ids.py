"""Ids (``new_id``): RFC 4648 base32hex of a UUIDv7's 16 bytes, so that their order is the
bytes' order, which is creation order."""

from __future__ import annotations

from base64 import b32hexencode

from hypothesis import given
from hypothesis import strategies as st

from tether._runtime.state import id_source, new_id

sixteen = st.binary(min_size=16, max_size=16)


def made_from(raw: bytes, prefix: str = "d") -> str:
    with id_source(lambda: raw):
        return new_id(prefix)


@given(sixteen)
def test_an_id_is_the_bytes_in_base32hex(raw: bytes) -> None:
    assert made_from(raw) == "d_" + b32hexencode(raw).decode("ascii")[:26].lower()


@given(sixteen, sixteen)
def test_ids_sort_as_their_bytes(a: bytes, b: bytes) -> None:
    assert (made_from(a) < made_from(b)) == (a < b)


def test_the_extremes() -> None:
    assert made_from(bytes(16), "a") == "a_" + "0" * 26
    assert made_from(b"\xff" * 16, "a") == "a_" + "v" * 25 + "s"  # 2 padding bits: 11100
