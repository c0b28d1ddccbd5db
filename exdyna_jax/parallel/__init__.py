"""Running a method on a mesh: data_parallel, NNX and linen steps, mesh axes, checks, resize."""
