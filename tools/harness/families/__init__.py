"""Which model families of the installed mlx-lm kvstore persists and restores identically.

    python -m tools.harness.families                 # every family; results into tools/harness/families/results/
    python -m tools.harness.families --only llama4,gemma3_text --out /tmp/x

See ``survey`` (what is run and compared) and ``configs`` (the tiny configs).
"""
