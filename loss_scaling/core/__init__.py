"""The core: the three scaler states (scalers), every field of a state declared once
(fields), the checks of one value (validation), the update rule (update), the headroom
growth rule's home (headroom), the numerics of a step (numerics) and
scale/unscale/all_finite (tree). Imports no framework.
"""
