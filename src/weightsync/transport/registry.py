"""Registry of checkpoint engines by name, with lazy import of optional backends."""

from __future__ import annotations

import importlib
from typing import Any, Callable, TypeVar

from weightsync.core.errors import BackendUnavailable

__all__ = ["CheckpointEngineRegistry"]

T = TypeVar("T")


class CheckpointEngineRegistry:
    """Maps backend names to engine classes.

    Built-in backends are registered lazily: ``register_lazy(name, "module")`` records the
    module that defines ``name``; it is imported on first use. If that import fails (an
    optional dependency is missing), the error is kept and shown by :meth:`get`.
    """

    _engines: dict[str, type] = {}
    _lazy: dict[str, str] = {}
    _import_errors: dict[str, BaseException] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[T], T]:
        """Class decorator: ``@CheckpointEngineRegistry.register("shm")``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"backend name must be a non-empty str, got {name!r}")

        def deco(engine_cls: T) -> T:
            existing = cls._engines.get(name)
            if existing is not None and existing is not engine_cls:
                raise ValueError(f"backend {name!r} is already registered to {existing!r}")
            cls._engines[name] = engine_cls
            engine_cls.backend_name = name  # type: ignore[attr-defined]
            return engine_cls

        return deco

    @classmethod
    def register_lazy(cls, name: str, module: str) -> None:
        cls._lazy.setdefault(name, module)

    @classmethod
    def _load(cls, name: str) -> None:
        module = cls._lazy.get(name)
        if module is None or name in cls._engines or name in cls._import_errors:
            return
        try:
            importlib.import_module(module)
        except ImportError as exc:
            cls._import_errors[name] = exc

    @classmethod
    def get(cls, name: str) -> type:
        """The engine class for ``name``; ``BackendUnavailable`` if it cannot be imported."""
        cls._load(name)
        if name in cls._engines:
            return cls._engines[name]
        if name in cls._import_errors:
            err = cls._import_errors[name]
            raise BackendUnavailable(
                f"backend {name!r} is registered but its module could not be imported: "
                f"{type(err).__name__}: {err}") from err
        raise ValueError(f"unknown backend {name!r}; known: {cls.names(available_only=False)}")

    @classmethod
    def new(cls, name: str, *args: Any, **kwargs: Any) -> Any:
        """Construct an engine of backend ``name``."""
        return cls.get(name)(*args, **kwargs)

    @classmethod
    def names(cls, *, available_only: bool = True) -> list[str]:
        """Registered backend names (by default only those whose import works)."""
        if not available_only:
            return sorted(set(cls._engines) | set(cls._lazy))
        for name in list(cls._lazy):
            cls._load(name)
        return sorted(cls._engines)

    @classmethod
    def import_error(cls, name: str) -> BaseException | None:
        cls._load(name)
        return cls._import_errors.get(name)
