"""Registers ``delta+cuda_ipc``, ``fp8+cuda_ipc`` and ``delta+fp8+cuda_ipc``; the registry
imports this module lazily, on the first ask for one of them."""

from weightsync.transport.codec.engine import register_wrapped

NAMES = register_wrapped("cuda_ipc")
