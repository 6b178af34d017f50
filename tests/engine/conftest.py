"""Fixtures shared by the engine tests."""

import pytest
from factories import make_model_files


@pytest.fixture(scope="module")
def files():
    """The tiny random model every engine variant is compared on."""
    return make_model_files(seed=1)
