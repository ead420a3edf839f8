"""The optax wrapper: its state and options (state), the one guarded step (step), and
with_loss_scaling / apply_gradients (transform).
"""
