"""The data-parallel learner of the forecasting job: data, model, optimizers, combine order.

Everything here is placement-aware but bit-deterministic: the same sequence of
placements gives the same bits in one process (the oracle) or in many owners.
"""
