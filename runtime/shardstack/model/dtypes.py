"""The one dtype table: the names users write (job configs say fp32/bf16/fp16, export and serving say
float32/bfloat16/float16) and the safetensors codes of the export format."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# engine.precision's short names for the same three.
PRECISIONS: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SAFETENSORS: dict[torch.dtype, str] = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def to_dtype(name: str) -> torch.dtype:
    """A dtype from either naming scheme; KeyError for anything else (callers validate names first)."""
    return DTYPES[PRECISIONS.get(name, name)]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
