"""The `sglang` engine adapter (see `engine.py`)."""
