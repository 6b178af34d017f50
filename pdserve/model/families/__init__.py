"""The model families `model/registry.py` names: what each adds to the shared decoder."""
