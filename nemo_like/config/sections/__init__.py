"""The sections of the config schema, one module each; :mod:`nemo_like.config.schema` re-exports them all."""
