"""Names and defaults the command line shows before anything heavy loads: this module imports
nothing, so ``layer-boundary --help`` lists them without importing torch."""

BOUNDARY_REDUCTIONS = ("ar", "rs", "rsv", "rs+rsv", "auto")
START_TIMEOUT_S = 300.0  # how long a spawned rank may take to start (import, load, join)
