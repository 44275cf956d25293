"""Cut the part of OpenAI's OpenAPI document that Tandem serves out of a checkout of
github.com/openai/openai-openapi and write it to ``tests/data/openai-openapi/``.

    git clone https://github.com/openai/openai-openapi /tmp/openai-openapi
    python scripts/vendor_openai_spec.py /tmp/openai-openapi

Kept: the operations in ``OPERATIONS`` and every component they reference, verbatim, less the
documentation site's ``x-oaiMeta`` blocks (code samples in six languages). The commit it came
from goes into ``SOURCE.md`` beside it; the tests read only the vendored files, nothing is
downloaded at test time. A refresh can add fields to OpenAI's request schemas:
``tests/unit/test_openai_spec_fields.py`` then fails until each is honoured or refused.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "openai-openapi"
# path -> methods Tandem serves (under /v1)
OPERATIONS = {"/chat/completions": ("post",), "/completions": ("post",), "/models": ("get",)}


def _strip_meta(node):
    if isinstance(node, dict):
        return {k: _strip_meta(v) for k, v in node.items() if k != "x-oaiMeta"}
    if isinstance(node, list):
        return [_strip_meta(v) for v in node]
    return node


def subset(spec: dict) -> dict:
    """The document with only ``OPERATIONS`` and the components they reach through ``$ref``."""
    paths = {path: {m: spec["paths"][path][m] for m in methods} for path, methods in OPERATIONS.items()}
    seen: set[tuple[str, str]] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/"):
                kind, name = ref.split("/")[2:4]
                if (kind, name) not in seen:
                    seen.add((kind, name))
                    walk(spec["components"][kind][name])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(paths)
    components: dict[str, dict] = {}
    for kind, name in sorted(seen):
        components.setdefault(kind, {})[name] = spec["components"][kind][name]
    head = {k: spec[k] for k in ("openapi", "info", "servers", "security") if k in spec}
    security = spec.get("components", {}).get("securitySchemes")
    if security:
        components["securitySchemes"] = security
    return _strip_meta({**head, "paths": paths, "components": components})


def main(checkout: Path) -> None:
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    spec = yaml.safe_load((checkout / "openapi.yaml").read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "openapi.yaml").write_text(yaml.safe_dump(subset(spec), sort_keys=False, allow_unicode=True))
    (OUT / "LICENSE").write_text((checkout / "LICENSE").read_text())
    (OUT / "SOURCE.md").write_text(
        "# OpenAI's OpenAPI document, the part Tandem serves\n\n"
        f"- Source: https://github.com/openai/openai-openapi, `openapi.yaml` at commit `{commit}`\n"
        f"  (info.version {spec['info']['version']}); MIT licence, `LICENSE` beside this file.\n"
        f"- Kept: {', '.join(f'{m.upper()} {p}' for p, ms in OPERATIONS.items() for m in ms)} and every\n"
        "  component they reference, verbatim, less the `x-oaiMeta` documentation blocks.\n"
        "- Made by `python scripts/vendor_openai_spec.py CHECKOUT`; read by\n"
        "  `tests/unit/test_openai_spec_fields.py` and `tests/integration/test_openai_contract.py`.\n")
    print(f"wrote {OUT} from {commit}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
