"""Gradients of spatial ops: conv2d_transpose, adaptive_avg_pool2d."""

from __future__ import annotations

GRADIENTS: dict = {}
