"""wamkit: fine-tune, serve and evaluate world action models and robot policies."""

__version__ = "0.1.0"
