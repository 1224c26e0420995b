"""Checkpoint format converters. Importing this package registers every shipped converter, so
:func:`get_converter` finds them without any code naming a format."""

from moe_registry.formats import (  # noqa: F401  (imported to register)
    awq_gemm,
    compressed_tensors_pack,
    fp8_block,
    gptq,
    modelopt_mxfp8,
    quark_int8,
    unquantized,
)
from moe_registry.formats.registry import (
    ConvertContext,
    Converter,
    ExpertTensors,
    get_converter,
    known_converters,
    register_converter,
)

__all__ = ["ConvertContext", "Converter", "ExpertTensors", "get_converter", "known_converters",
           "register_converter"]
