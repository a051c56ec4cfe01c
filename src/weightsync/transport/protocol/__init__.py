"""The bucketed sync protocol shared by ``shm``, ``collective`` and ``cuda_ipc``: the
sender (:mod:`.sender`), the receiver (:mod:`.receiver`) and who sends what
(:mod:`.ownership`). Backends subclass :class:`~.sender.BucketedEngine` and supply the data
path.
"""
