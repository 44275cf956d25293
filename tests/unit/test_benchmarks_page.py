"""docs/benchmarks.md can be rerun from a fresh clone (issue 34): every command in its current
table names a benchmark that is in this repository (``python -m scripts.X``, ``python -m
loadtest.X`` or ``tandem bench MODE``) and uses only flags that the benchmark's ``--help`` lists,
and no line of the page cites a script or path outside the repository.

One ``--help`` subprocess per distinct benchmark, run side by side; nothing is timed."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
TABLE_HEADING = "## Current figures"
COLUMNS = ("What", "Tandem", "Peer", "Ratio", "Machine, date", "Command")
# A flag whose value is a command line of its own (quoted on the page): its value's flags belong
# to another program (`tandem up`, a worker), not to the benchmark.
PASS_THROUGH = re.compile(r"^--[\w-]*-args$")
FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")
OUTSIDE = re.compile(r"(?<![\w.:/-])(/work/|/tmp/|/home/|/root/|/mnt/|/opt/|/scratch/|~/|\.\./)")
SCRIPT_NAME = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.(?:py|sh|c|h))\b")


def _table_rows() -> list[list[str]]:
    text = PAGE.read_text()
    assert TABLE_HEADING in text, f"docs/benchmarks.md has no {TABLE_HEADING!r} section"
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    assert tuple(header) == COLUMNS, f"the current table's columns are {header}, not {COLUMNS}"
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines[2:]]
    for row in rows:
        assert len(row) == len(COLUMNS), f"row {row[0]!r} has {len(row)} cells, not {len(COLUMNS)}"
    return rows


def _commands(row: list[str]) -> list[str]:
    return re.findall(r"`([^`]+)`", row[COLUMNS.index("Command")])


def _target(command: str) -> tuple[Path, tuple[str, ...], list[str]]:
    """The benchmark's source file, its ``--help`` argv and the flags the command passes it."""
    words = shlex.split(command)
    if words[:2] == ["python", "-m"] and len(words) > 2:
        module, args = words[2], words[3:]
        match = re.fullmatch(r"(scripts|loadtest)\.(\w+)", module)
        assert match, f"`{command}`: {module} is not a scripts.X or loadtest.X benchmark"
        source = ROOT / match.group(1) / f"{match.group(2)}.py"
        help_argv = (sys.executable, "-m", module, "--help")
    elif words[:2] == ["tandem", "bench"] and len(words) > 2:
        mode, args = words[2], words[3:]
        source = ROOT / "loadtest" / f"{mode}.py"
        help_argv = (sys.executable, "-m", "services.runtime.cli", "bench", mode, "--help")
    else:
        raise AssertionError(f"`{command}` is neither `python -m scripts.X ...` nor `tandem bench MODE ...`")
    flags, skip = [], False
    for word in args:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if FLAG.match(name):
            flags.append(name)
            skip = bool(PASS_THROUGH.match(name)) and "=" not in word
    return source, help_argv, flags


ROWS = _table_rows()
# A row is named by its "What" cell without the link to its section.
CASES = [(re.sub(r"\s*\(\[[^\]]*\]\([^)]*\)\)", "", row[0]), command)
         for row in ROWS for command in _commands(row)]


def _help(argv: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def helps() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    argvs = set()
    for _, command in CASES:
        try:
            source, help_argv, _ = _target(command)
        except AssertionError:
            continue  # the row's own test says why
        if source.is_file():
            argvs.add(help_argv)
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(argvs, pool.map(_help, argvs)))


def test_the_table_has_rows_and_each_a_command():
    assert len(ROWS) >= 10
    missing = [row[0] for row in ROWS if not _commands(row)]
    assert not missing, f"rows of docs/benchmarks.md's table without a command: {missing}"


@pytest.mark.parametrize("what,command", CASES, ids=[c for _, c in CASES])
def test_row_command_exists_and_takes_its_flags(what, command, helps):
    source, help_argv, flags = _target(command)
    assert source.is_file(), f"row {what!r}: `{command}` needs {source.relative_to(ROOT)}, not in the repository"
    done = helps[help_argv]
    assert done.returncode == 0, (f"row {what!r}: `{' '.join(help_argv[1:])}` exited {done.returncode}:\n"
                                  f"{done.stderr[-2000:]}")
    listed = done.stdout + done.stderr
    unknown = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", listed)]
    assert not unknown, f"row {what!r}: `{command}` uses flags its --help does not list: {unknown}"


def test_no_line_cites_a_path_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    names = {Path(p).name for p in tracked}
    bad = []
    for number, line in enumerate(PAGE.read_text().splitlines(), 1):
        if OUTSIDE.search(line):
            bad.append(f"line {number}: {OUTSIDE.search(line).group(0)!r} in {line.strip()!r}")
        for name in SCRIPT_NAME.findall(line):
            found = (ROOT / name).exists() if "/" in name else name in names
            if not found:
                bad.append(f"line {number}: {name} is not in the repository")
    assert not bad, "docs/benchmarks.md cites what a fresh clone lacks:\n" + "\n".join(bad)


def test_every_benchmark_the_page_names_is_in_the_repository():
    text = PAGE.read_text()
    missing = [f"python -m {m}" for m in set(re.findall(r"python -m ((?:scripts|loadtest)\.\w+)", text))
               if not (ROOT / (m.replace(".", "/") + ".py")).is_file()]
    missing += [f"tandem bench {m}" for m in set(re.findall(r"tandem bench (\w+)", text))
                if not (ROOT / "loadtest" / f"{m}.py").is_file()]
    missing += [f"image {p}" for p in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
                if not (PAGE.parent / p).is_file()]
    assert not missing, f"docs/benchmarks.md names what the repository lacks: {sorted(missing)}"
