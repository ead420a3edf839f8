"""Framework integrations (linen TrainState, flax nnx, Equinox). Each imports its
framework and the core, never the reverse: the core reaches nnx and Equinox only
through the hooks they register in loss_scaling._registry.
"""
