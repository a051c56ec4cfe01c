"""What the package declares: version ranges (installable next to a user's stack), the
exact versions of the project's own venv in constraints.txt, and its type hints."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import weightsync

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[;\s]", req, maxsplit=1)[0].lower()


def _pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt pins exact versions: {line!r}"
            out[name.lower()] = version
    return out


def test_dependencies_are_ranges_and_constraints_pin_them():
    pins = _pins()
    reqs = list(PROJECT["dependencies"])
    for extra, items in PROJECT["optional-dependencies"].items():
        if extra not in ("docs", "vllm"):     # docs: the Makefile pins; vllm: CUDA only
            reqs += items
    for req in reqs:
        assert "==" not in req, f"{req}: a range, not a pin (pins go to constraints.txt)"
        assert _name(req) in pins, f"{_name(req)} is not pinned in constraints.txt"
    assert "torch>=2.11" in PROJECT["dependencies"]


def test_the_makefile_installs_with_the_constraints():
    makefile = (ROOT / "Makefile").read_text()
    installs = [line for line in makefile.splitlines() if "-e '.[" in line]
    assert installs and all("-c $(CONSTRAINTS)" in line for line in installs), installs
    assert re.search(r"^TORCH_SPEC\s*\?=\s*torch==2\.13\.0\+cpu$", makefile, re.M)


def test_ships_its_type_hints():
    assert (Path(weightsync.__file__).parent / "py.typed").is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in data["package-data"]["weightsync"]
