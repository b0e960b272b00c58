"""The GPU speed suite used by benchmarks/gpu_speed.py (not part of the ditbook package)."""
