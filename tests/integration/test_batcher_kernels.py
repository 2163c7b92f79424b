"""The optional CUDA kernels' CPU fallback: same results, CuPy never imported without CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from monolith import cupy_kernels


def test_scatter_add_adds_every_repeat_of_a_row() -> None:
    table = torch.zeros(5, dtype=torch.int64)
    cupy_kernels.scatter_add(table, torch.tensor([0, 3, 3, 4, 3]), torch.tensor([1, 2, 3, 4, 5]))
    assert table.tolist() == [1, 0, 0, 10, 4]


def test_scatter_add_refuses_rows_outside_the_table_and_ragged_input() -> None:
    table = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(IndexError, match=r"rows: every row must be in \[0, 3\)"):
        cupy_kernels.scatter_add(table, torch.tensor([3]), torch.tensor([1]))
    with pytest.raises(ValueError, match="same length"):
        cupy_kernels.scatter_add(table, torch.tensor([0, 1]), torch.tensor([1]))
    assert table.tolist() == [0, 0, 0]


def test_importing_the_kernels_never_imports_cupy() -> None:
    code = "import sys, monolith.cupy_kernels as k; k.scatter_add; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_the_torch_fallback_is_used() -> None:
    assert not cupy_kernels.available()
