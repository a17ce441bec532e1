"""The tests the README and the guides cite exist: every ``tests/...py`` path, and every ``file.py::name`` test."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?")


def test_every_test_the_docs_cite_exists() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
    cited = [(doc.name, m.group(1), m.group(2)) for doc in docs for m in CITED.finditer(doc.read_text())]
    assert len(cited) > 20  # the scan finds the citations
    missing = []
    for doc, path, name in cited:
        file = ROOT / path
        if not file.is_file():
            missing.append(f"{doc}: {path}")
        elif name and not re.search(rf"^(async )?def {name}\(", file.read_text(), re.MULTILINE):
            missing.append(f"{doc}: {path}::{name}")
    assert missing == []
