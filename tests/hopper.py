"""The mark of the tests that need the H200: the ``gpu`` marker and a skip, with its reason,
on machines without a Hopper GPU and tilelang (CI)."""

import pytest

from mqa_bwd import backends

REASON = "needs a Hopper (sm_90) CUDA GPU and tilelang"
NEEDS_HOPPER = pytest.mark.skipif(not backends.hopper_available(), reason=REASON)
#: pytestmark (or marks=) of a test that runs on the H200 only.
ON_HOPPER = [pytest.mark.gpu, NEEDS_HOPPER]
