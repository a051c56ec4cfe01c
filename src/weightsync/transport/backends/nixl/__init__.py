"""``nixl``: point-to-point pull over NIXL: trainer ranks serve registered memory
(:mod:`.layout`), rollout workers read what they keep on a compiled plan
(:mod:`.engine`, :mod:`weightsync.core.xferplan`), through one NIXL agent each (:mod:`.agent`).
"""
