"""Attention kernels behind one interface; see ``nanovllm.layers.attention`` for the choice."""
