"""The `hf` engine adapter (see `engine.py`)."""
