"""Registers ``delta+inproc``, ``fp8+inproc`` and ``delta+fp8+inproc``; the registry
imports this module lazily, on the first ask for one of them."""

from weightsync.transport.codec.engine import register_wrapped

NAMES = register_wrapped("inproc")
