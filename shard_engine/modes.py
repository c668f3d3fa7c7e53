"""The sharding's settings as plain names, importable without torch (``server.config`` offers them
as choices of its options, and ``hsdp-serve --help`` imports nothing heavier)."""

MESH_AXES = ("replicate", "shard")
ENCODER_MODES = ("shard", "replicate")
"""``HSDPInferenceConfig.encoder``: an image-text model's encoder as units, or whole on every rank."""
