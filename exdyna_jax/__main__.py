"""``python -m exdyna_jax demo ...``: see `exdyna_jax._cli`."""

import sys

from exdyna_jax._cli import main

sys.exit(main())
