"""Shared PyTorch runtime for plugins (imports torch: import these modules only when loading)."""
