"""Benchmark tools (run on purpose, never timed asserts in the test suite)."""
