"""Registers ``delta+collective``, ``fp8+collective`` and ``delta+fp8+collective``; the registry
imports this module lazily, on the first ask for one of them."""

from weightsync.transport.codec.engine import register_wrapped

NAMES = register_wrapped("collective")
