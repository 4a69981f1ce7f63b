"""The `deepspeed` engine adapter (see `engine.py`)."""
