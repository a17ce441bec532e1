"""One registry mechanism for every kind of plug-in a recipe names (advantage estimators, KL estimators,
loss plug-ins, environments, tools, reward functions).

A recipe names an entry either by its registered name (``"grpo"``, ``"k3"``, ``"math"``) or by an
import path to user code that is not registered: ``"package.module:object"`` or
``"path/to/file.py:object"``. :meth:`Registry.get` returns the object; an unknown name, a failing
import or an object of the wrong kind raises :class:`PluginNameError` (a
:class:`~nemo_like.config.errors.ConfigError`) whose message starts with the config key and suggests
the closest registered name. Built-ins may be registered lazily by import path (:meth:`Registry.add_path`)
so that listing the names imports nothing.

The config schema keeps plain strings; the names are checked after loading, from above
(:func:`nemo_like.algorithms.names.check_plugin_names`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from nemo_like.config.errors import ConfigError, did_you_mean
from nemo_like.utils.imports import import_object, is_import_path

T = TypeVar("T")

#: ``validate(obj, name, key)``: raise :class:`PluginNameError` when ``obj`` is not of the registry's kind.
Validator = Callable[[object, str, str], None]
#: ``unknown(name, key, registered_names)``: the message for a name that is neither registered nor an import path.
UnknownMessage = Callable[[str, str, list[str]], str]


class PluginNameError(ConfigError):
    """A plug-in name that does not resolve; ``key`` is the config key that holds it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def require_callable(obj: object, name: str, key: str) -> None:
    """The default validator: the object an import path names must be callable."""
    if not callable(obj):
        raise PluginNameError(key, f"{key}: {name!r} is not callable")


class Registry(Generic[T]):
    """Name -> object (or the import path of a built-in, imported on first use), plus import paths for
    user code; one instance per kind of plug-in."""

    def __init__(
        self,
        kind: str,
        config_key: str,
        *,
        validate: Validator = require_callable,
        unknown: UnknownMessage | None = None,
        user_code: str = "'package.module:function'",
    ) -> None:
        self.kind = kind
        self.config_key = config_key
        self._validate = validate
        self._unknown = unknown
        self._user_code = user_code
        self._entries: dict[str, T] = {}
        self._paths: dict[str, str] = {}  # lazily imported built-ins: name -> 'module:object'

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

    def add(self, name: str, obj: T) -> None:
        """Register ``obj`` under ``name`` (see :meth:`register`)."""
        self._check_new(name)
        self._entries[name] = obj

    def add_path(self, name: str, path: str) -> None:
        """Register the object at import path ``path`` under ``name``; it is imported by :meth:`get`."""
        self._check_new(name)
        self._paths[name] = path

    def _check_new(self, name: str) -> None:
        if is_import_path(name):
            raise ValueError(f"{self.kind} name {name!r} must not contain ':' (reserved for import paths)")
        if name in self._entries or name in self._paths:
            raise ValueError(f"{self.kind} {name!r} is already registered")

    def names(self) -> list[str]:
        return sorted([*self._entries, *self._paths])

    def path_of(self, name: str) -> str | None:
        """The import path a lazily registered built-in was added with (``None`` otherwise)."""
        return self._paths.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._paths

    def __iter__(self) -> Iterator[str]:
        """The names in registration order."""
        return iter([*self._entries, *self._paths])

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def get(self, name: str, key: str | None = None) -> T:
        """The registered object, or the object an import path names.

        ``key`` (default :attr:`config_key`) is the config key named in errors.

        Raises:
            PluginNameError: unknown name (with a did-you-mean hint), a failing import path, or an
                object the registry's validator rejects.
        """
        key = key or self.config_key
        if name in self._entries:
            return self._entries[name]
        path = self._paths.get(name)
        if path is None and not is_import_path(name):
            raise PluginNameError(key, self._unknown_message(name, key))
        try:
            obj = import_object(path or name)
        except ValueError as exc:
            raise PluginNameError(key, f"{key}: {exc}") from None
        if path is None:
            self._validate(obj, name, key)
        return obj  # type: ignore[return-value]

    def check(self, name: str, key: str | None = None) -> str:
        """Validate ``name`` (importing user code) and return it unchanged; raises like :meth:`get`."""
        self.get(name, key)
        return name

    def _unknown_message(self, name: str, key: str) -> str:
        if self._unknown is not None:
            return self._unknown(name, key, self.names())
        return (
            f"{key}: unknown {self.kind} {name!r}.{did_you_mean(name, self.names())} "
            f"Registered: {self.names()}; user code: {self._user_code}."
        )
