"""Saving and restoring loss scales: the JSON state-dict format (state_dict, with
_values), configuration comparison and adoption (config), restore into optimizer states
(restore), the flax record with its CRC (flax_record), and the Orbax helpers (orbax,
which imports Orbax; imported on first use).
"""
