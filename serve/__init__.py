"""Starts a real tritonserver on this repository's model repository (``python -m serve``)."""
