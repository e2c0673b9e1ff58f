"""kvmem._ids.as_page_ids: the one coercion of page ids.
What it accepts comes out as a contiguous int32/int64 [n] tensor with the same values;
bool and float ids, in any container, are refused with a ValueError naming them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmem._ids import as_page_ids

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "ids",
    [
        [3, 1, 2],
        (3, 1, 2),
        [np.int64(3), np.int32(1), 2],
        [torch.tensor(3), 1, 2],  # 0-d integer tensors have __index__
        np.array([3, 1, 2]),
        np.array([3, 1, 2], dtype=np.int32),
        np.array([3, 1, 2], dtype=np.uint8),
        np.array([3, 1, 2], dtype=">i8"),  # big-endian
        np.array([3, 9, 1, 9, 2])[::2],  # strided
        torch.tensor([3, 1, 2]),
        torch.tensor([3, 1, 2], dtype=torch.int32),
        torch.tensor([3, 1, 2], dtype=torch.int16),
        torch.tensor([3, 1, 2], dtype=torch.uint8),
        torch.tensor([3, 9, 1, 9, 2])[::2],  # strided
    ],
    ids=lambda x: f"{type(x).__name__}",
)
def test_accepted_forms_give_the_same_ids(ids):
    got = as_page_ids(ids, CPU)
    assert got.dtype in (torch.int32, torch.int64) and got.dim() == 1
    assert got.is_contiguous() and got.stride() == (1,)
    assert got.tolist() == [3, 1, 2]


def test_range_and_empty():
    assert as_page_ids(range(2, 5), CPU).tolist() == [2, 3, 4]
    for empty in ([], (), np.array([], dtype=np.int64), torch.empty(0, dtype=torch.int64)):
        got = as_page_ids(empty, CPU)
        assert got.shape == (0,) and got.dtype in (torch.int32, torch.int64)


def test_strided_tensor_is_made_contiguous_with_its_own_values():
    # Item 1: torch.tensor([1, 2, 3, 4])[::2] is [1, 3]; the kernels read ids at stride
    # 1, so a strided tensor must reach them as a contiguous copy.
    t = torch.tensor([1, 2, 3, 4])[::2]
    got = as_page_ids(t, CPU)
    assert got.is_contiguous() and got.tolist() == [1, 3]
    assert t.tolist() == [1, 3]  # the caller's tensor is left alone


def test_int64_option_and_kept_dtypes():
    t32 = torch.tensor([1, 2], dtype=torch.int32)
    assert as_page_ids(t32, CPU) is t32  # int32 kept, no copy
    assert as_page_ids(t32, CPU, int64=True).dtype == torch.int64
    t64 = torch.tensor([1, 2])
    assert as_page_ids(t64, CPU) is t64  # the common case returns the tensor itself
    assert as_page_ids(np.array([1, 2], dtype=np.int32), CPU, int64=True).dtype == torch.int64


def test_numpy_on_cpu_is_zero_copy_when_it_can_be():
    a = np.array([4, 5, 6], dtype=np.int64)
    got = as_page_ids(a, CPU)
    assert got.data_ptr() == a.ctypes.data
    ro = np.array([4, 5], dtype=np.int64)
    ro.flags.writeable = False
    assert as_page_ids(ro, CPU).tolist() == [4, 5]  # copied, no warning, no error


@pytest.mark.parametrize(
    "ids, named",
    [
        ([True], "True"),
        ([1, False], "False"),
        ([1.7], "1.7"),
        ([2.0], "2.0"),
        ([np.bool_(True)], "True"),
        ([np.float32(3)], "3.0"),
        ([torch.tensor(True)], "True"),
        ([torch.tensor(2.0)], "2."),
        (["3"], "'3'"),
        ([[1, 2]], r"\[1, 2\]"),
        ([None], "None"),
        ([2**64], str(2**64)),
        ([-(2**63) - 1], str(-(2**63) - 1)),
    ],
)
def test_bad_python_ids_are_refused_by_value(ids, named):
    with pytest.raises(ValueError, match=named):
        as_page_ids(ids, CPU)


@pytest.mark.parametrize(
    "ids, msg",
    [
        (torch.tensor([True, False]), "torch.bool"),
        (torch.tensor([1.0]), "torch.float32"),
        (torch.tensor([1.0], dtype=torch.float64), "torch.float64"),
        (torch.tensor([1 + 0j]), "complex"),
        (np.array([True, False]), r"bool \[True, False\]"),
        (np.array([1.5]), r"float64 \[1.5\]"),
        (np.array(["1"]), "dtype <U1"),
        (np.array([2**63], dtype=np.uint64), f"page id {2**63} does not fit in int64"),
        (torch.tensor([[1, 2]]), "must be 1-D"),
        (torch.tensor(3), "must be 1-D"),
        (np.array([[1]]), "must be 1-D"),
        (torch.tensor([1], device="meta"), "are on meta, the KV buffers on cpu"),
        ("12", "got str"),
        (b"12", "got bytes"),
        (3, "got int 3"),
        (None, "got NoneType"),
        ({1, 2}, "got set"),
    ],
)
def test_bad_containers_are_refused(ids, msg):
    with pytest.raises(ValueError, match=msg):
        as_page_ids(ids, CPU)


def test_messages_name_the_argument_and_owner():
    with pytest.raises(ValueError, match=r"^free: pages must be integers, got True"):
        as_page_ids([True], CPU, what="free: pages", where="the allocator")
    with pytest.raises(ValueError, match="free: pages are on meta, the allocator on cpu"):
        as_page_ids(
            torch.tensor([1], device="meta"), CPU, what="free: pages", where="the allocator"
        )
