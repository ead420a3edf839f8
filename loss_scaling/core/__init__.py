"""The core: the three scaler states (scalers), their validation (validation), the update
rule (update), the numerics of a step (numerics) and scale/unscale/all_finite (tree).
Imports no framework.
"""
