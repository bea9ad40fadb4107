"""Ring collectives, sans-IO: segment and chunk schedules, reductions, buffer backends."""
