"""The control plane of the multi-process backends: the authenticated store server and
client (:mod:`.server`, :mod:`.store`), direct peer links (:mod:`.links`) and the group
mixin that sets them up per engine (:mod:`.group`).
"""
