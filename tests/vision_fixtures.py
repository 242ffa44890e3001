"""Fixtures of the vision tests (a pytest plugin that tests/conftest.py loads): a tiny Qwen2-VL folder built from a
seed, the model loaded from it, and four one-colour pictures, each made once per test module."""

from pathlib import Path

import pytest

from visionrows import save_pictures


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    from alignrl.models.tiny_vl import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("vl") / "tiny-vl", seed=0)


@pytest.fixture(scope="module")
def vl(vl_dir):
    """(model, tokenizer) of `vl_dir`."""
    from alignrl.models.loader import load_model

    return load_model(str(vl_dir))


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, Path]:
    return save_pictures(tmp_path_factory.mktemp("pictures"))
