"""The bottom layer: errors, numerics, dtypes, names, findings, machine facts, tolerances, data paths. Imports nothing else of the harness."""
