"""``python -m moe_registry`` runs the CLI."""

import sys

from moe_registry.cli.main import main

sys.exit(main())
