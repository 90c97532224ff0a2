"""The KV cache: the attention keys and values a sequence keeps while it generates."""
