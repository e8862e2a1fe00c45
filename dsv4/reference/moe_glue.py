"""Torch providers of the MoE layer glue ops (``moe_route``, ``moe_permute``, ``moe_combine``).

The ops are registered under module ``moe_glue`` (their CuTe DSL providers are in
``kernels_dsl/moe_glue.py``); the reference bodies live with the other MoE references in
:mod:`dsv4.reference.moe` (:func:`~dsv4.reference.moe.route_ref`,
:func:`~dsv4.reference.moe.permute_ref`, :func:`~dsv4.reference.moe.combine_ref`).
"""
from __future__ import annotations

from .moe import GLUE_PROVIDERS

PROVIDERS = dict(GLUE_PROVIDERS)
