"""SteeringVector refuses a fractional layer (``int(2.7)`` silently steered layer 2) and a complex vector."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mechprobe.errors import UsageError
from mechprobe.steering.vector import SteeringVector


@pytest.mark.parametrize("layer", [2.7, -0.5, "2", None, True, torch.tensor(2.5)])
def test_layer_must_be_a_whole_number(layer):
    with pytest.raises(UsageError, match="layer"):
        SteeringVector(torch.ones(4), layer=layer)


@pytest.mark.parametrize("layer", [2, 2.0, np.int64(2), torch.tensor(2)])
def test_whole_layers_of_any_integer_type(layer):
    v = SteeringVector(torch.ones(4), layer=layer)
    assert v.layer == 2 and type(v.layer) is int


@pytest.mark.parametrize("vec", [torch.ones(4, dtype=torch.complex64), torch.ones(4, dtype=torch.bool)])
def test_vector_must_be_real(vec):
    with pytest.raises(UsageError, match="real tensor"):
        SteeringVector(vec, layer=1)


def test_still_a_value_error_for_library_callers():
    with pytest.raises(ValueError):
        SteeringVector(torch.ones(4), layer=1.5)
