"""The error-feedback shell every method runs in: the guard, density schedules, init/update."""
