"""docs/architecture.md's map from folder to concept (issue 34) stays in step with the tree: every
top-level folder of the repository and every package or module directly under ``services/`` has a
row, and every row names something that exists. A new module that nobody placed fails here."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def _map_rows() -> set[str]:
    text = DOC.read_text()
    section = text.split("## Map: folder to concept", 1)[1].split("\n## ", 1)[0]
    return {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", section, re.M)}


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def _tree_entries() -> set[str]:
    """Top-level tracked folders, and services/' direct packages and modules."""
    entries: set[str] = set()
    for path in _tracked():
        parts = path.split("/")
        if len(parts) > 1 and not parts[0].startswith("."):
            entries.add(parts[0] + "/")
        if parts[0] == "services" and len(parts) >= 2 and parts[1] != "__init__.py":
            if len(parts) == 2 and parts[1].endswith(".py"):
                entries.add(f"services/{parts[1]}")
            elif len(parts) > 2:
                entries.add(f"services/{parts[1]}/")
    entries.discard("services/")
    return entries


def test_every_folder_and_services_module_has_a_row():
    missing = _tree_entries() - _map_rows()
    assert not missing, f"add a row to docs/architecture.md's map for: {sorted(missing)}"


def test_every_row_names_something_that_exists():
    """In git, not only on this disk: an ignored folder (bench-results/) is not in a clone."""
    present: set[str] = set()
    for path in _tracked():
        parts = path.split("/")
        present.add(path)
        present.update("/".join(parts[:i]) + "/" for i in range(1, len(parts)))
    gone = _map_rows() - present
    assert not gone, f"docs/architecture.md's map names paths that are gone: {sorted(gone)}"


def test_the_map_reads_the_table():
    rows = _map_rows()
    assert {"services/runtime/", "services/engine/", "kernels/", "services/errors.py"} <= rows
