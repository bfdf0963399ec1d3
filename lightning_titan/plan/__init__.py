"""``titan plan``: what a layout costs before it runs (model state per rank so far)."""
