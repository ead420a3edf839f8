"""The optax wrapper: its state and options (state), with_loss_scaling / apply_gradients and
the one guarded step (transform), where its state may sit (placement), the trace-time
scaling check (provenance) and replay (replay).
"""
