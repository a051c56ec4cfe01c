"""The README's quick start is a complete program: the same file as
examples/quickstart.py, and it runs as is on CPU with no environment to set."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICKSTART = ROOT / "examples" / "quickstart.py"


def first_python_block(text: str) -> str:
    match = re.search(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)
    assert match, "README.md has no ```python block"
    return match.group(1)


def test_first_python_block_is_examples_quickstart():
    block = first_python_block(README.read_text(encoding="utf-8"))
    assert QUICKSTART.exists(), "examples/quickstart.py is missing"
    assert block == QUICKSTART.read_text(encoding="utf-8"), (
        "README.md's first ```python block differs from examples/quickstart.py")


@pytest.mark.timeout(180)
def test_quickstart_runs_as_is(tmp_path):
    """The block as written to a fresh file, run from an empty folder, with no
    WEIGHTSYNC_* variable set, exits 0."""
    script = tmp_path / "quickstart.py"
    script.write_text(first_python_block(README.read_text(encoding="utf-8")), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "trainer:" in proc.stdout and "rollout:" in proc.stdout, proc.stdout


def test_readme_is_short_and_links_resolve():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
