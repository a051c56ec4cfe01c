"""Ray layer: worker mixins, ready-made workers, local cluster helpers.

Importing this package does not import Ray; the helpers in ``cluster`` do, on use.
"""

from weightsync.integrations.ray.mixins import RolloutWorkerMixin, TrainerWorkerMixin

__all__ = ["TrainerWorkerMixin", "RolloutWorkerMixin"]
