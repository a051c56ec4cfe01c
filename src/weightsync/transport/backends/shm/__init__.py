"""``shm``: one-host sync through POSIX shared-memory segments (:mod:`.engine`,
:mod:`.segments`)."""
