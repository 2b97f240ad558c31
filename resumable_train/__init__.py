"""Exact resume for fastai training: kill a run anywhere, rerun it, and end where an uninterrupted run ends."""
__version__ = "0.5.0"
