"""The loader's modes as plain names, importable without torch (``server.config`` offers them as
choices of its options, and ``hsdp-serve --help`` imports nothing heavier)."""

READ_MODES = ("sliced", "full")
"""``load_hsdp_model``'s ``read_mode``: each rank reads its rows only, or whole tensors that
``fully_shard`` chunks."""
