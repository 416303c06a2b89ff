"""Model-side helpers: the attention context, tensor-parallel groups, checkpoint loading."""
