"""The package's face: ``tether`` holds what an application builds with, reads and catches;
every error is in ``tether.errors``, the protocol under the API in ``tether.protocol``; a name
that moved is still found where it was, with a warning that says where it went."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import tether
from tether import errors, protocol
from tether._core import errors as core_errors


def test_the_top_level_is_small_and_every_name_resolves() -> None:
    names = [n for n in tether.__all__ if n not in ("__version__", "errors", "protocol")]
    assert len(names) <= 27, names
    for name in tether.__all__:
        assert getattr(tether, name) is not None
    # Protocol internals are not the application's API.
    for internal in ("ControlIntent", "Signed", "RecallInput", "JournalFacts",
                     "evaluate_recall", "AttemptFacts"):
        assert internal not in tether.__all__ and internal in protocol.__all__


def test_every_error_is_in_tether_errors() -> None:
    raised = {name for name, value in vars(errors).items()
              if inspect.isclass(value) and issubclass(value, BaseException)}
    assert raised == set(errors.__all__)
    # Every error the core defines, wherever it is raised from, is there.
    defined = {name for name, value in vars(core_errors).items()
               if inspect.isclass(value) and issubclass(value, BaseException)
               and value.__module__ == core_errors.__name__}
    assert defined <= raised, defined - raised
    for name in tether.__all__:  # the errors an application catches are at tether too
        value = getattr(tether, name)
        if inspect.isclass(value) and issubclass(value, BaseException):
            assert getattr(errors, name) is value


@pytest.mark.parametrize(("name", "home"), [("ControlIntent", protocol), ("Malformed", errors),
                                            ("SigningKey", protocol), ("StaleEpoch", errors),
                                            ("UserError", errors), ("HookEvent", protocol),
                                            ("Hooks", protocol)])
def test_a_moved_name_is_found_with_a_warning_naming_its_new_place(name: str,
                                                                   home: object) -> None:
    with pytest.warns(DeprecationWarning, match=f"tether.{name} moved to "
                                                 f"{home.__name__}.{name}"):  # type: ignore
        assert getattr(tether, name) is getattr(home, name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        getattr(tether, "no_such_thing")  # noqa: B009


def test_a_type_checker_does_not_find_a_moved_name_at_tether(tmp_path: Path) -> None:
    """The moved names answer at run time only: to mypy ``tether.Malformed`` is an error that
    names it (not Any, which would let any misspelt ``tether.X`` pass)."""
    from mypy import api

    code = "import tether\nimport tether.errors\ntether.errors.Malformed\ntether.Malformed\n"
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n")
    out, _, status = api.run(["--strict", "--config-file", str(config), "--cache-dir",
                              str(tmp_path / "cache"), "-c", code])
    assert status == 1 and out.count("error:") == 1, out
    assert 'Module has no attribute "Malformed"' in out, out
