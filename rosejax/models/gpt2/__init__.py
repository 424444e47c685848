"""GPT-2 (every size), exactly as Hugging Face's `GPT2LMHeadModel`."""
