"""The adapter conformance suite: oracle resharder, base test classes, pytest plugin."""
