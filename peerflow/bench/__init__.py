"""Benchmarks behind `peerflow bench` (each prints JSON)."""
