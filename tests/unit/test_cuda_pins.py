"""The CUDA image installs one CUDA major: base image, torch, triton and NIXL agree, as the
packages' own metadata says (``scripts/cuda_pins.py``; offline, from the committed
``docker/cuda-metadata.json``). Then: each rule of the check fails on an input that breaks it."""
from __future__ import annotations

import copy
import json
import tomllib

import pytest

from scripts import cuda_pins
from services.kv_transfer import nixl_agent

ROOT = cuda_pins.ROOT


@pytest.fixture(scope="module")
def files() -> dict:
    return {"dockerfile": (ROOT / "Dockerfile").read_text(),
            "constraints": cuda_pins.CONSTRAINTS.read_text(),
            "metadata": json.loads(cuda_pins.METADATA.read_text()),
            "pyproject": tomllib.loads((ROOT / "pyproject.toml").read_text()),
            "packages_script": (ROOT / "scripts" / "python_packages.sh").read_text()}


def test_the_cuda_pins_agree_on_one_major(files):
    assert cuda_pins.check(**files) == []
    major, base = cuda_pins.base_cuda_major(files["dockerfile"])
    assert major == 13 and base.startswith("nvidia/cuda:13.")
    metadata = files["metadata"]
    assert metadata["target"] == {"python_version": "3.12", "platform": "manylinux_2_28_x86_64"}
    torch_wheel = metadata["packages"]["torch"]["wheel"]
    assert torch_wheel.startswith("torch-2.13.0-cp312-") and "+cpu" not in torch_wheel


def test_the_pinned_nixl_is_one_the_workers_load(files):
    (nixl,) = [n for n in cuda_pins.read_pins(files["constraints"]) if n.startswith("nixl")]
    assert nixl.replace("-", "_") in nixl_agent._MODULES


def test_a_base_image_of_another_major_is_caught(files):
    broken = dict(files, dockerfile=files["dockerfile"].replace(
        "ARG CUDA_BASE=nvidia/cuda:13.0.0-", "ARG CUDA_BASE=nvidia/cuda:12.8.1-"))
    problems = cuda_pins.check(**broken)
    assert any("requires cuda-toolkit for CUDA 13; the base image nvidia/cuda:12.8.1" in p
               for p in problems), problems
    assert any("nixl-cu13 is not the CUDA 12 build" in p for p in problems), problems


def test_a_nixl_of_another_major_is_caught(files):
    metadata = copy.deepcopy(files["metadata"])
    metadata["packages"]["nixl-cu12"] = metadata["packages"].pop("nixl-cu13")
    broken = dict(files, metadata=metadata,
                  constraints=files["constraints"].replace("nixl-cu13==", "nixl-cu12=="))
    problems = cuda_pins.check(**broken)
    assert any("nixl-cu12 is not the CUDA 13 build of NIXL" in p for p in problems), problems
    assert any("nixl extra" in p for p in problems), problems


def test_a_triton_torch_does_not_require_is_caught(files):
    metadata = copy.deepcopy(files["metadata"])
    metadata["packages"]["triton"]["version"] = "3.6.0"
    broken = dict(files, metadata=metadata,
                  constraints=files["constraints"].replace("triton==3.7.1", "triton==3.6.0"))
    assert any("requires triton==3.7.1" in p and "the pin is triton==3.6.0" in p
               for p in cuda_pins.check(**broken))


def test_stale_metadata_asks_for_a_refresh(files):
    broken = dict(files, constraints=files["constraints"].replace("torch==2.13.0", "torch==2.14.0"))
    (problem,) = cuda_pins.check(**broken)
    assert "--refresh" in problem


def test_a_cpu_torch_wheel_is_caught(files):
    metadata = copy.deepcopy(files["metadata"])
    torch_reqs = metadata["packages"]["torch"]["requires_dist"]
    metadata["packages"]["torch"]["requires_dist"] = [
        r for r in torch_reqs if not r.startswith(("cuda-", "nvidia-"))]
    assert any("requires no CUDA packages" in p
               for p in cuda_pins.check(**dict(files, metadata=metadata)))


def test_the_torch_pin_is_the_one_setup_installs(files):
    broken = dict(files, packages_script=files["packages_script"].replace('"torch==2.13.0"',
                                                                          '"torch==2.12.0"'))
    assert any("python_packages.sh installs torch ['2.12.0']" in p
               for p in cuda_pins.check(**broken))


def test_requirement_majors():
    assert cuda_pins.cuda_majors([
        'cuda-toolkit[cublas]==13.0.3; platform_system == "Linux"',
        'cuda-bindings<14,>=13.0.3; platform_system == "Linux"',
        "nvidia-nccl-cu12==2.27.3", "filelock", "nvidia-ml-py>=12"]) == {
        "cuda-toolkit": 13, "cuda-bindings": 13, "nvidia-nccl-cu12": 12}
    with pytest.raises(ValueError, match="exact pin"):
        cuda_pins.read_pins("torch>=2.13\n")
