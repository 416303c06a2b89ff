"""The model's layers: attention and its backends, linear, norm, rotary, embedding and mixture-of-experts."""
