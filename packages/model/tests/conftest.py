"""Fixtures shared by the model tests."""

from __future__ import annotations

import mindspore as ms
import pytest


@pytest.fixture
def graph_mode():
    old = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=old)
