"""The tiny random model of tests/engine (one per session) for the in-process hand-off tests."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for engine.conftest


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    from engine.conftest import _make_tiny
    return _make_tiny(tmp_path_factory)


@pytest.fixture(scope="session")
def demo_dir() -> str:
    from dsv4.assets import demo_model_dir
    return demo_model_dir()
