"""The pieces of bench/benchmark_serving.py (the script holds `main`)."""
