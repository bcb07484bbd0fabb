"""Triton kernels run here in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set before
triton is imported), against their torch references in dsv4/ops. On the GPU machine the same
tests run compiled (`DSV4_TRITON_DEVICE=cuda`)."""
import os

import pytest

if os.environ.get("DSV4_TRITON_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is part of the test extra")


@pytest.fixture
def device():
    return os.environ.get("DSV4_TRITON_DEVICE", "cpu")
