"""The vocabulary of one call: the request kinds the runtime runs and the Work it returns."""
