"""The `fsdp` engine adapter (see `engine.py`)."""
