"""`python -m cem_jax.train --config configs/X.yaml key=value ...` (same as `cem-train`)."""

import sys

from cem_jax.cli.train import main

sys.exit(main())
