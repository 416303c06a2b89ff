"""Helpers of the model side: the attention context, tensor-parallel groups, checkpoint loading."""
