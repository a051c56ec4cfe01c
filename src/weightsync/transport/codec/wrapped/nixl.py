"""Registers ``delta+nixl``, ``fp8+nixl`` and ``delta+fp8+nixl``; the registry
imports this module lazily, on the first ask for one of them."""

from weightsync.transport.codec.engine import register_wrapped

NAMES = register_wrapped("nixl")
