"""Registers ``delta+shm``, ``fp8+shm`` and ``delta+fp8+shm``; the registry
imports this module lazily, on the first ask for one of them."""

from weightsync.transport.codec.engine import register_wrapped

NAMES = register_wrapped("shm")
