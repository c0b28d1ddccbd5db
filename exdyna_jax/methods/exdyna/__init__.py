"""ExDyna: partitions and their balancing, selection before the threshold, the step, the factory."""
