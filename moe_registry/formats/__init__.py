"""Stage 5, checkpoint formats: every change of a weight's layout up to the kernel's input. The converters turn
a format's tensors into :class:`~moe_registry.formats.weights.ExpertWeights` (declared as data in
``specs/formats/``, imported only when a layer is built). May import: checkpoint, oracle, situation, spec, core."""

from moe_registry.formats.registry import ConvertContext, Converter, ExpertTensors, get_converter, known_converters

__all__ = ["ConvertContext", "Converter", "ExpertTensors", "get_converter", "known_converters"]
