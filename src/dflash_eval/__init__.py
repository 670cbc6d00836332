"""dflash-eval: a trustworthy acceptance length (tau) for DFlash drafters, from cached target states."""

__version__ = "0.1.0"
