"""The staleness study: grids of runs (sweep), collapse and its early warning, and the report."""
