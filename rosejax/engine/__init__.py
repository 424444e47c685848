"""The host side: `LLMEngine`, its scheduler, the block manager and each request's state."""
