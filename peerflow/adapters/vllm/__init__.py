"""The `vllm` engine adapter (see `engine.py`)."""
