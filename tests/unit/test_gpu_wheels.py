"""scripts/gpu_wheels.py: which packages a GPU machine is given as wheels, from this
environment's installed requirements and the image's package list."""
from __future__ import annotations

from importlib import metadata

import pytest

from scripts.gpu_wheels import image_packages, wheels

KINDS = """## Python packages already there

nvidia-h200: their image holds these. Packages: annotated-types, grpcio, Jinja2, numpy, protobuf,
pydantic_core, torch, typing-extensions, uvloop.
"""


def test_the_image_list_is_read_with_normalised_names():
    assert image_packages(KINDS) == {"annotated-types", "grpcio", "jinja2", "numpy", "protobuf",
                                     "pydantic-core", "torch", "typing-extensions", "uvloop"}
    with pytest.raises(ValueError, match="Packages"):
        image_packages("no list here")


def test_what_the_image_lacks_goes_at_the_installed_version_and_grpc_always():
    out = dict(line.split("==") for line in wheels(image_packages(KINDS)))
    # run-time requirements and their own (pydantic-settings -> pydantic, python-dotenv)
    for name in ("pydantic", "pydantic-settings", "python-dotenv", "redis", "fastapi",
                 "starlette", "uvicorn", "gguf", "llguidance", "opentelemetry-sdk"):
        assert out[name] == metadata.version(name)
    assert out["grpcio"] == metadata.version("grpcio") and "protobuf" in out  # the image's: too old
    for name in ("torch", "numpy", "triton", "pydantic-core", "jinja2", "uvloop"):
        assert name not in out  # the image's (torch, numpy, triton: built for its CUDA)
    for name in ("pytest", "transformers", "matplotlib", "nixl-cu12"):
        assert name not in out  # extras (test, bench, nixl) are not run-time needs
