"""Tool calling for multi-turn environments: Hermes/Qwen ``<tool_call>`` parsing, a tool registry
(built-ins by name, user functions by import path), the built-in ``calculator`` and sandboxed
``python`` tools, and :class:`~nemo_like.environments.tools.environment.ToolEnvironment`.
See ``docs/guides/tools.md``."""
