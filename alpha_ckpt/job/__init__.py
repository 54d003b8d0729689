"""The built-in forecasting job: the first client of the collective layer (see owner.py)."""
