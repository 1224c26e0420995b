"""The optional transformers dependency: one line saying what to install when it is missing or outside the
version range the whole-model path is tested with (pyproject.toml's ``transformers`` extra says the same)."""

from __future__ import annotations

import re
from types import ModuleType

from moe_registry.core.errors import ConfigError

TESTED = ((5, 17), (6, 0))
"""transformers versions the whole-model path is tested with: at least the first, below the second
(transformers 5 carries the experts contract, ``ExpertsInterface`` and the checkpoint conversion mapping)."""
INSTALL = "pip install 'moe-registry[transformers]'"


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def require_transformers() -> ModuleType:
    """The transformers module, or ConfigError in one line when it is absent or outside :data:`TESTED`."""
    lo, hi = TESTED
    wanted = f"transformers>={lo[0]}.{lo[1]},<{hi[0]}"
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"whole models need transformers ({wanted}), which is not installed: {INSTALL}") from None
    have = _version_tuple(transformers.__version__)
    if not lo <= have < hi:
        raise ConfigError(f"whole models need {wanted}; this environment has transformers {transformers.__version__}"
                          f": {INSTALL}")
    return transformers
