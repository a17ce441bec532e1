"""Generation engines in their own actors (HF transformers, vLLM) behind one interface, and the choice of backend
(:mod:`.choice`). The factory that builds the chosen one, inline generation in the policy worker included, is
:mod:`nemo_like.models.engines`."""
