"""``python -m exdyna_jax.launch ...``: see `exdyna_jax.launch`."""

import sys

from exdyna_jax.launch import main

sys.exit(main())
