"""The model's layers: attention, linear, norm, rotary, embedding and mixture-of-experts."""
