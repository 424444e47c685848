"""The Llama-style decoder family: Llama (2, 3, 3.1, 3.2), Qwen2, Qwen3 and Mistral (without a
sliding window). One config with the flags that tell them apart, one Flax model, one key map."""
