"""Tensor dtypes by the names the contract and the cache entries use (`TensorSpec.dtype`)."""

from __future__ import annotations

import torch

DTYPE_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
NAME_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in DTYPE_BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return NAME_BY_DTYPE[dtype]
