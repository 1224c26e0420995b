"""Beside the stages, for tests and tools: the conformance case generator and the packers that
write checkpoint tensors. May import every stage."""
