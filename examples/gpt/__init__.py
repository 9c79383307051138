"""The pieces of ``examples/train_gpt.py``: model, data, strategies, training loop,
observability."""
