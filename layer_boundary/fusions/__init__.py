"""Fusion providers; none are in this slice yet."""
