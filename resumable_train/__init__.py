"""Exact resume for fastai training: kill a run anywhere, rerun it, and end bit-for-bit where an uninterrupted run ends."""
__version__ = "0.1.0"
from . import learner, autoresume, distributed  # noqa: F401  (importing the package patches fastai's Learner)
