"""Stage 1, the spec language: safe YAML, shape expressions, the pydantic models of scheme,
kernel, family and format specs, and the loader that validates them into a Registry.
May import: core."""
