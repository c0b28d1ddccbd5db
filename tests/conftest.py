"""Test setup: 8 forced CPU devices, before the backend starts."""

import chex

chex.set_n_cpu_devices(8)
