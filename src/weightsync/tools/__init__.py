"""Tools on top of the library: the ``weightsync`` CLI (:mod:`.cli`), the demo
(:mod:`.demo`) and the bench (:mod:`.bench`)."""
