"""The README's example runs as written, and its Quick start matches .ci/run."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


async def test_readme_example_runs(tmp_path: Path) -> None:
    example = code_blocks("python")[0]  # the full example; later blocks are fragments
    script = tmp_path / "example.py"
    script.write_text(example)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert out.decode().split()[0] in ("RECALLED", "RECONCILED", "SUCCEEDED")
    assert (tmp_path / ".tether" / "journal.db").exists()


def test_quick_start_has_two_commands_and_ci_runs_the_second() -> None:
    first = code_blocks("bash")[0]
    commands = [ln for ln in first.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(commands) == 2
    assert "tether demo" in commands[0]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
