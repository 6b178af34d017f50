"""Llama-family model and its weight/tokenizer loaders."""
