"""Test modules outside tests/ops_triton never import Triton when collected: pytest loads
tests/ops_triton/conftest.py (which sets TRITON_INTERPRET=1, read when Triton defines its
kernels) only when collection reaches that folder, so an earlier import would leave every
interpreted kernel calling compiled `tl` helpers ("Cannot call @triton.jit'd outside of the
scope of a kernel")."""
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TOP_LEVEL_IMPORT = re.compile(r'^(import triton\b|from triton\b|\w+ = pytest\.importorskip\(["\']triton)', re.M)


def test_no_module_level_triton_import_outside_ops_triton():
    offenders = [str(path.relative_to(TESTS)) for path in sorted(TESTS.rglob("*.py"))
                 if "ops_triton" not in path.parts and TOP_LEVEL_IMPORT.search(path.read_text())]
    assert offenders == [], f"import Triton inside the tests, not at module level: {offenders}"
