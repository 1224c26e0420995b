"""Stage 1, the spec language: safe YAML, shape expressions, how a field rule reads a config, the pydantic
models of scheme, kernel, family and format specs, and the loader that validates them into a Registry.
May import: core."""
