"""Stage 3, checkpoint formats: the converters that turn a format's tensors into the kernel layout
(:class:`~moe_registry.formats.weights.ExpertWeights`), declared as data in ``specs/formats/`` and
imported only when a layer is built. May import: spec, core."""

from moe_registry.formats.registry import ConvertContext, Converter, ExpertTensors, get_converter, known_converters

__all__ = ["ConvertContext", "Converter", "ExpertTensors", "get_converter", "known_converters"]
