"""The model's building blocks, each choosing between a Pallas kernel and its XLA path."""
