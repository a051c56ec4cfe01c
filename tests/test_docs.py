"""Docs hold no history and stay short; the full site build (`make docs`, run by
`make test`) checks links, references and the generated options tables."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HISTORY = re.compile(r"\bsession \d+|\b20\d\d-\d\d-\d\d\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b",
                     re.I)


def doc_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_no_history_in_docs():
    found = []
    for path in doc_files():
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in HISTORY.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{no}: {m.group(0)}")
    assert not found, "history belongs in CHANGELOG.md / git log:\n" + "\n".join(found)


def test_benchmarks_page_is_short():
    assert len((ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()) <= 400

