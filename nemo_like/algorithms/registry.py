"""Named registries of pluggable functions (advantage estimators, surrogates, KL estimators, ...).

A recipe names an entry either by its registered name (``"grpo"``, ``"k3"``) or by an import path
``"package.module:object"`` (or ``"path/to/file.py:object"``) for user code that is not registered.
:meth:`Registry.check` validates a name at config time (the error names the config key and
suggests the closest registered name); :meth:`Registry.get` returns the function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from nemo_like.config.errors import did_you_mean
from nemo_like.utils.imports import import_object, is_import_path

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> function, plus import paths for user code; one instance per kind of plug-in."""

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``fn`` under ``name``.

        Raises:
            ValueError: ``name`` is taken (a silent override would change training maths) or
                contains ':' (reserved for import paths).
        """

        def decorator(fn: T) -> T:
            self.add(name, fn)
            return fn

        return decorator

    def add(self, name: str, fn: T) -> None:
        """Register ``fn`` under ``name`` (see :meth:`register`)."""
        if is_import_path(name):
            raise ValueError(f"{self.kind} name {name!r} must not contain ':' (reserved for import paths)")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = fn

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def get(self, name: str) -> T:
        """The registered function, or the object an import path names.

        Raises:
            ValueError: unknown name (with a did-you-mean hint) or a failing import path; the
                message names :attr:`config_key`.
        """
        if name in self._entries:
            return self._entries[name]
        if is_import_path(name):
            try:
                obj = import_object(name)
            except ValueError as exc:
                raise ValueError(f"{self.config_key}: {exc}") from None
            if not callable(obj):
                raise ValueError(f"{self.config_key}: {name!r} is not callable")
            return obj  # type: ignore[return-value]
        raise ValueError(
            f"{self.config_key}: unknown {self.kind} {name!r}.{did_you_mean(name, self.names())} "
            f"Registered: {self.names()}; user code: 'package.module:function'."
        )

    def check(self, name: str) -> str:
        """Validate ``name`` (importing user code) and return it unchanged; raises like :meth:`get`."""
        self.get(name)
        return name
