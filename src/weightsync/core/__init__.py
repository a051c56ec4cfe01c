"""The core layer: errors, configuration, the bucket plan and the wire format.

Imports nothing else of weightsync; every other layer builds on it.
"""
