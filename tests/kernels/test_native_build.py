"""Where the C kernels' libraries come from (``kernels.native``, ``kernels.cpu_kernels``): prebuilt once per CPU family
with the best family this CPU runs loaded at run time, a stale or missing prebuilt library
replaced by a build here, and a loud WARNING when a kernel cannot be loaded at all."""
from __future__ import annotations

import ctypes
import logging
import platform
import shutil

import pytest

from kernels import cpu_attention, cpu_kernels, decode_ops, native, quant, sampling

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not (shutil.which("cc") or shutil.which("gcc")),
    reason="needs an x86_64 CPU and a C compiler")

# what a kernel compiled for each family reports, from the macros its flags define
PROBE = r"""
int tandem_family(void) {
#if defined(__AVX512BF16__)
    return 4;
#elif defined(__AVX512VNNI__)
    return 3;
#elif defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}
"""
CODES = {"x86_64": 0, "avx2": 1, "avx512": 2, "avx512_vnni": 3, "avx512_bf16": 4}
HASWELL = frozenset({"sse4_2", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe",
                     "xsave"})
SKYLAKE_SP = HASWELL | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
CASCADE_LAKE = SKYLAKE_SP | {"avx512_vnni"}
ZEN4 = CASCADE_LAKE | {"avx512_bf16", "avx512_vbmi"}


@pytest.fixture
def probe_csrc(tmp_path, monkeypatch):
    """A csrc folder holding only the probe kernel, an empty prebuilt folder, an empty cache."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "probe.c").write_text(PROBE)
    monkeypatch.setattr(native, "CSRC", csrc)
    monkeypatch.setattr(native, "prebuilt_dir", lambda: tmp_path / "prebuilt")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return csrc / "probe.c"


def family_of(path) -> int:
    return ctypes.CDLL(str(path)).tandem_family()


@pytest.mark.parametrize("flags, best", [
    (frozenset({"sse2"}), ["x86_64"]),
    (HASWELL, ["avx2", "x86_64"]),
    (SKYLAKE_SP, ["avx512", "avx2", "x86_64"]),
    (CASCADE_LAKE, ["avx512_vnni", "avx512", "avx2", "x86_64"]),
    (ZEN4, ["avx512_bf16", "avx512_vnni", "avx512", "avx2", "x86_64"]),
    (HASWELL - {"fma"}, ["x86_64"]),  # AVX2 without FMA: not x86-64-v3
])
def test_families_a_cpu_runs_best_first(flags, best):
    assert [f.name for f in native.runnable_families(flags)] == best


def test_each_family_is_compiled_with_its_instruction_set(probe_csrc):
    built = native.prebuild(native.prebuilt_dir(), cpu_attention.CFLAGS, cpu_attention.LDFLAGS)
    assert len(built) == len(CODES)
    runnable = {f.name for f in native.runnable_families()}
    for path in built:
        name = path.name.split("-")[1]
        assert path.parent == native.prebuilt_dir() and name in CODES
        if name in runnable:  # only these can be loaded on this CPU
            assert family_of(path) == CODES[name], path.name


def test_loader_picks_the_best_prebuilt_family_this_cpu_runs(probe_csrc, monkeypatch):
    native.prebuild(native.prebuilt_dir(), cpu_attention.CFLAGS, cpu_attention.LDFLAGS)
    runnable = native.runnable_families()
    got = native.shared_library(probe_csrc, cpu_attention.CFLAGS, cpu_attention.LDFLAGS)
    assert got.parent == native.prebuilt_dir() and family_of(got) == CODES[runnable[0].name]
    assert native.outcomes()["probe"].startswith(f"prebuilt for {runnable[0].name}")
    assert not (native.cache_dir()).exists()  # nothing compiled at load

    # a CPU reporting only AVX2 gets the AVX2 build (which this CPU can run too)
    monkeypatch.setattr(native, "cpu_flags", lambda: HASWELL)
    got = native.shared_library(probe_csrc, cpu_attention.CFLAGS, cpu_attention.LDFLAGS)
    assert family_of(got) == CODES["avx2"]


def test_a_missing_family_falls_back_to_the_next_best(probe_csrc, monkeypatch):
    native.prebuild(native.prebuilt_dir(), cpu_attention.CFLAGS, cpu_attention.LDFLAGS,
                    names=["x86_64", "avx2"])
    # a CPU running every family, where only the two lowest were prebuilt
    monkeypatch.setattr(native, "cpu_flags", lambda: ZEN4)
    path, family = native.find_prebuilt(probe_csrc, cpu_attention.CFLAGS, cpu_attention.LDFLAGS)
    assert family.name == "avx2" and path.name.startswith("probe-avx2-")


def test_a_prebuilt_library_of_other_sources_is_not_used(probe_csrc):
    native.prebuild(native.prebuilt_dir(), cpu_attention.CFLAGS, cpu_attention.LDFLAGS)
    probe_csrc.write_text(PROBE.replace("return 0;", "return 9;").replace(
        "int tandem_family", "int tandem_other(void) { return 7; }\nint tandem_family"))
    got = native.shared_library(probe_csrc, cpu_attention.CFLAGS, cpu_attention.LDFLAGS)
    assert got.parent == native.cache_dir()  # built here, with -march=native
    assert ctypes.CDLL(str(got)).tandem_other() == 7
    assert native.outcomes()["probe"].startswith("built here (-march=native)")


def test_without_prebuilt_libraries_or_a_compiler_the_error_says_both(probe_csrc, monkeypatch):
    monkeypatch.setattr(native, "_compiler", lambda compiler: None)
    with pytest.raises(RuntimeError, match="no prebuilt kernels .* no C compiler found"):
        native.shared_library(probe_csrc, cpu_attention.CFLAGS, cpu_attention.LDFLAGS)
    assert native.outcomes()["probe"].startswith("not loaded: no prebuilt kernels")


def test_unknown_family_is_refused(probe_csrc):
    with pytest.raises(RuntimeError, match="families: avx1024 unknown"):
        native.prebuild(native.prebuilt_dir(), cpu_attention.CFLAGS, cpu_attention.LDFLAGS,
                        names=["avx1024"])


@pytest.fixture
def fresh_kernels():
    """Each kernel module loads its library again on next use (and after the test)."""
    loaders = (cpu_attention._library, quant._library, decode_ops.lib, sampling.lib)
    for fn in loaders:
        fn.cache_clear()
    yield
    for fn in loaders:
        fn.cache_clear()


def test_worker_start_warns_loudly_naming_each_missing_kernel(tmp_path, monkeypatch, caplog,
                                                              fresh_kernels):
    monkeypatch.setattr(native, "prebuilt_dir", lambda: tmp_path / "prebuilt")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_compiler", lambda compiler: None)
    with caplog.at_level(logging.INFO, logger="kernels"):
        assert cpu_kernels.log_loaded() is False
    (warning,) = [r for r in caplog.records if r.name == "kernels.cpu_kernels"]
    assert warning.levelno == logging.WARNING
    text = warning.getMessage()
    assert text.startswith("CPU KERNELS NOT LOADED")
    for kernel in ("paged_decode_attention", "quant_matmul", "decode_ops", "sampling"):
        assert f"{kernel} (not loaded: no prebuilt kernels" in text
    assert "no C compiler found" in text and "quantization auto resolves to none" in text
    assert not quant.available() and not cpu_attention.available()


def test_worker_start_logs_the_build_each_kernel_uses(tmp_path, monkeypatch, caplog,
                                                      fresh_kernels):
    if "avx2" not in {f.name for f in native.runnable_families()}:
        pytest.skip("this CPU cannot run the AVX2 build")
    monkeypatch.setattr(native, "prebuilt_dir", lambda: tmp_path / "prebuilt")
    native.prebuild(tmp_path / "prebuilt", cpu_attention.CFLAGS, cpu_attention.LDFLAGS,
                    names=["avx2"])
    monkeypatch.setattr(native, "_compiler", lambda compiler: None)  # nothing compiled here
    with caplog.at_level(logging.INFO, logger="kernels"):
        assert cpu_kernels.log_loaded() is True
    (info,) = [r for r in caplog.records if r.name == "kernels.cpu_kernels"]
    assert info.levelno == logging.INFO
    for kernel in ("paged_decode_attention", "quant_matmul", "decode_ops", "sampling"):
        assert f"{kernel} prebuilt for avx2" in info.getMessage()


@pytest.mark.parametrize("device, reported", [("cpu", True), ("cuda", False)])
def test_a_cpu_worker_reports_its_kernels_before_loading_the_engine(monkeypatch, device, reported):
    from types import SimpleNamespace

    from services.runtime import serve
    from services.engine import engine as engine_module

    calls = []
    monkeypatch.setattr(cpu_kernels, "log_loaded", lambda: calls.append("kernels"))

    class FakeEngine:
        def __init__(self, config, fault_injection, kv_events):
            calls.append("engine")

        def warm_up(self):
            return 0.0

    monkeypatch.setattr(engine_module, "LLMEngine", FakeEngine)
    monkeypatch.setattr(serve, "role_engine_config", lambda opts: opts.engine)
    opts = SimpleNamespace(engine=SimpleNamespace(device=device), fault_injection=False,
                           publish_kv_events=False)
    serve._load_engine(opts)
    assert calls == (["kernels", "engine"] if reported else ["engine"])
