"""Processes that never run the engine do not import torch: ``tandem up``'s own process (the
CLI, the settings tree, the launcher) and the gateway. ``import torch`` costs about 3 CPU s,
and ``tandem up`` starts these beside its workers on the same cores."""
from __future__ import annotations

import subprocess
import sys

import pytest

CODE = """
import sys
import {module}
print(sorted(m for m in {heavy!r} if m in sys.modules))
"""

# Not needed before a process serves (or at all, for these): torch and what torch pulls in.
HEAVY = ("torch", "numpy", "sympy", "transformers", "gguf")


@pytest.mark.parametrize("module", ["services.config.settings", "services.runtime.cli", "services.runtime.launcher",
                                    "services.gateway.app", "services.runtime.serve"])
def test_non_engine_modules_import_no_torch(module):
    out = subprocess.run([sys.executable, "-c", CODE.format(module=module, heavy=HEAVY)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", (module, out.stdout, out.stderr[-2000:])


def test_settings_still_build_the_engine_config():
    from services.engine.engine import EngineConfig as ReExported
    from services.engine.engine_config import EngineConfig
    from services.config.settings import Settings

    assert ReExported is EngineConfig
    assert isinstance(Settings().engine.engine_config(), EngineConfig)
