"""Where settings come from: flags > ``TANDEM_*`` environment variables > config file > defaults.

``load_settings()`` reads each source into the tree of ``services/config/settings.py`` and remembers,
per leaf, where its value came from, so a bad value fails at start-up naming the setting and
its source (``gateway.port: Input should be a valid integer, unable to parse string as an
integer (got 'x' from env TANDEM_PORT)``)
and ``tandem config show`` prints every effective value beside its source. The config file is
YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON (``.json``; what ``tandem up`` hands its
children), nested by section: ``gateway: {port: 50051}``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import tomllib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from services.config.settings import ENGINE_HELP, ENGINE_NAMES, SECTIONS, Settings
from services.state.redis_server import redact_url

SECRET_LEAVES = {"transport.internal_secret", "gateway.api_key"}
URL_LEAVES = {"state.redis_url"}


class SettingsError(ValueError):
    """A setting failed validation; the message names each setting and its source."""


@dataclass(frozen=True)
class Leaf:
    """One setting: its dotted path (``gateway.port``), env var, flag (or None) and help."""
    path: str
    field: FieldInfo
    env: str
    flag: str | None
    help: str

    @property
    def default_text(self) -> str:
        if self.field.default_factory is not None:
            return "(see meaning)"
        value = self.field.default
        value = getattr(value, "value", value)
        return "" if value is None else str(value)


def leaves() -> list[Leaf]:
    """Every setting of the tree, top-level ones first, then section by section."""
    out = [_leaf(name, f) for name, f in Settings.model_fields.items() if name not in SECTIONS]
    for section in SECTIONS:
        model = Settings.model_fields[section].annotation
        out += [_leaf(f"{section}.{name}", f) for name, f in model.model_fields.items()]
    return out


def _leaf(path: str, field: FieldInfo) -> Leaf:
    name = path.rpartition(".")[2]
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    env, flag = extra.get("env"), extra.get("flag", "")
    if path.startswith("engine."):
        env, flag = ENGINE_NAMES.get(name, (None, ""))
    help_ = field.description or ENGINE_HELP.get(name, "")
    flag = ("--" + name.replace("_", "-")) if flag == "" else flag
    return Leaf(path, field, env or f"TANDEM_{name.upper()}", flag, help_)


# -- sources ---------------------------------------------------------------------------------
def env_values(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """Each leaf's own environment variable (an empty value counts as unset): dotted path ->
    (value, source text)."""
    return {leaf.path: (environ[leaf.env], f"env {leaf.env}") for leaf in leaves()
            if environ.get(leaf.env)}


def file_values(path: str | Path) -> dict[str, tuple[Any, str]]:
    """A YAML, TOML or JSON config file nested by section: dotted path -> (value, source text
    naming the file and line). Raises SettingsError for an unreadable or invalid file or an
    unknown setting."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"--config: cannot read {path}: {exc.strerror}") from exc
    try:
        data, lines = _parse(path.suffix.lower(), text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise SettingsError(f"--config: {path} is not valid: {exc}") from exc
    known = {leaf.path for leaf in leaves()}
    out = {}
    for key, value in _flatten(data or {}).items():
        where = f"file {path}" + (f" line {lines[key]}" if key in lines else "")
        if key not in known:
            raise SettingsError(f"{key}: unknown setting (from {where})")
        out[key] = (value, where)
    return out


def _parse(suffix: str, text: str) -> tuple[dict, dict[str, int]]:
    if suffix in (".yaml", ".yml"):
        return yaml.safe_load(text), _yaml_lines(yaml.compose(text))
    if suffix == ".toml":
        data = tomllib.loads(text)
    elif suffix == ".json":
        data = json.loads(text)
    else:
        raise SettingsError(f"--config: {suffix or 'no suffix'}: expected .yaml, .yml, .toml or .json")
    return data, _scan_lines(text, _flatten(data or {}))


def _yaml_lines(node, prefix: str = "") -> dict[str, int]:
    out: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = f"{prefix}{key.value}"
            out[path] = key.start_mark.line + 1
            out.update(_yaml_lines(value, path + "."))
    return out


def _scan_lines(text: str, flat: dict[str, Any]) -> dict[str, int]:
    """TOML/JSON: the first line naming each key after its section's header (no parser gives
    line numbers for these)."""
    lines = text.splitlines()
    out = {}
    for path in flat:
        section, _, name = path.rpartition(".")
        start = next((i for i, ln in enumerate(lines) if section and re.search(
            rf'^\s*(\[{section}\]|"{section}"\s*:)', ln)), 0)
        for i in range(start, len(lines)):
            if re.search(rf'^\s*"?{name}"?\s*[=:]', lines[i]):
                out[path] = i + 1
                break
    return out


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and not prefix and key in SECTIONS:
            out.update(_flatten(value, f"{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        section, _, name = path.rpartition(".")
        (out.setdefault(section, {}) if section else out)[name] = value
    return out


# -- flags -----------------------------------------------------------------------------------
FLAG_PREFIX = "setting:"


def add_setting_flags(parser: argparse.ArgumentParser,
                      select: Callable[[str], bool] = lambda path: True) -> None:
    """Add a flag for each setting whose dotted path ``select`` accepts. A flag has no default:
    an absent flag leaves the setting to the environment, the file or the tree's default."""
    for leaf in leaves():
        if leaf.flag is None or not select(leaf.path):
            continue
        kind = leaf.field.annotation
        choices = f" (one of {', '.join(m.value for m in kind)})" if _is_enum(kind) else ""
        kwargs: dict[str, Any] = dict(dest=FLAG_PREFIX + leaf.path, default=argparse.SUPPRESS,
                                      help=f"{leaf.help}{choices} [{leaf.env}]")
        if leaf.field.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = leaf.path.rpartition(".")[2].upper()
        parser.add_argument(leaf.flag, **kwargs)


def _is_enum(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, Enum)


def flag_values(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """The settings given as flags in ``args``: dotted path -> (value, "flag --name")."""
    by_path = {leaf.path: leaf for leaf in leaves()}
    return {dest[len(FLAG_PREFIX):]: (value, f"flag {by_path[dest[len(FLAG_PREFIX):]].flag}")
            for dest, value in vars(args).items() if dest.startswith(FLAG_PREFIX)}


# -- loading ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadedSettings:
    """The validated tree and, per dotted path, where its value came from."""
    settings: Settings
    sources: dict[str, str]

    def source(self, path: str) -> str:
        return self.sources.get(path, "default")


def load_settings(flags: Mapping[str, tuple[Any, str]] | None = None,
                  config_file: str | Path | None = None,
                  environ: Mapping[str, str] | None = None) -> LoadedSettings:
    """Validate flags > environment > config file > defaults into ``Settings``.

    ``flags``: dotted path -> (value, source text), as ``flag_values`` returns.
    Raises SettingsError naming every bad setting and its source.
    """
    environ = os.environ if environ is None else environ
    merged: dict[str, tuple[Any, str]] = {}
    if config_file:
        merged.update(file_values(config_file))
    merged.update(env_values(environ))
    merged.update(flags or {})
    try:
        settings = Settings(**_nest({k: v for k, (v, _) in merged.items()}))
    except ValidationError as exc:
        raise SettingsError(_explain(exc, merged)) from None
    return LoadedSettings(settings, {k: src for k, (_, src) in merged.items()})


def _explain(exc: ValidationError, merged: Mapping[str, tuple[Any, str]]) -> str:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"][:2])
        value, source = merged.get(path, (None, "default"))
        shown = "***" if path in SECRET_LEAVES else repr(
            redact_url(value) if path in URL_LEAVES and isinstance(value, str) else value)
        lines.append(f"{path}: {err['msg']} (got {shown} from {source})")
    return "invalid settings: " + "; ".join(lines)


def show_lines(loaded: LoadedSettings) -> list[str]:
    """``path = value  # source`` for every setting; secrets shown as ``***``."""
    dumped = _flatten(loaded.settings.model_dump(mode="json"))
    out = []
    for leaf in leaves():
        value = dumped.get(leaf.path)
        if leaf.path in SECRET_LEAVES and value is not None:
            value = "***"
        elif leaf.path in URL_LEAVES and value is not None:
            value = redact_url(value)
        out.append(f"{leaf.path} = {json.dumps(value)}  # {loaded.source(leaf.path)}")
    return out


def write_settings_file(settings: Settings, path: Path) -> None:
    """Write ``settings`` as JSON, secrets included, readable by this user only (0600): what
    ``tandem up`` hands its children with ``--config``."""
    data = settings.model_dump(mode="json")
    for leaf in SECRET_LEAVES:
        section, name = leaf.split(".")
        secret = getattr(getattr(settings, section), name)
        data[section][name] = None if secret is None else secret.get_secret_value()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)


def markdown_table() -> str:
    """The README's settings table, generated from the tree (a test keeps the README current)."""
    rows = ["| setting | flag | environment variable | default | meaning |",
            "|---|---|---|---|---|"]
    for leaf in leaves():
        flag = f"`{leaf.flag}`" if leaf.flag else ""
        default = f"`{leaf.default_text}`" if leaf.default_text else ""
        rows.append(f"| `{leaf.path}` | {flag} | `{leaf.env}` | {default} | "
                    f"{leaf.help.replace('|', '/')} |")
    return "\n".join(rows)
