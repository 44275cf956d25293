"""``bench serve`` says at once when it will write no plots (issue 34): matplotlib is the optional
``bench`` extra, and a run that only said so at its end left a user waiting for PNGs."""
from __future__ import annotations

import importlib.util

from loadtest import report


def test_missing_matplotlib_is_said_before_the_run(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert report.plots_available() is False
    assert "pip install 'tandem[bench]'" in capsys.readouterr().err


def test_installed_matplotlib_says_nothing(capsys):
    assert report.plots_available() is (importlib.util.find_spec("matplotlib") is not None)
    if importlib.util.find_spec("matplotlib") is not None:
        assert capsys.readouterr().err == ""
