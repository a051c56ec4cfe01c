"""One module or folder per transport; each registers itself lazily in
:mod:`weightsync.transport` and is imported on first use.
"""
