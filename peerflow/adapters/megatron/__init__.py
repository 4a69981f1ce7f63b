"""The `megatron` engine adapter (see `engine.py`)."""
