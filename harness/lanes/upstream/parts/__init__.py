"""The pieces a generated reproduce.py is made of (harness/lanes/upstream/script.py joins them).

Each piece is a valid module, so that ruff checks it and tests can import it: what stands above its
`# ---- reproduce.py ----` line (docstring, imports, names it takes from the other pieces) stays
here; what follows the line is copied into the script. `parameters.py` is never copied: the
generator writes the script's own parameters in its place. A piece imports only torch, safetensors,
the standard library and, inside functions, the engine's own package: never this project.

A piece's docstring becomes its section's comment in the script (the first line its title); a format
piece states each format's definition on a line `  NAME: W = ...` under `Definitions:`, which the
script, its docstring and ISSUE.md quote.
"""
