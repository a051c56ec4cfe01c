"""``cuda_ipc``: one-host GPU sync through CUDA IPC handles (:mod:`.engine`), with its
stream/event operations (:mod:`.ops`) and zero-copy references (:mod:`.refs`)."""
