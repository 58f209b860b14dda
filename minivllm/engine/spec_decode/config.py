"""`SpeculativeConfig`, by the path the engine's speculative decoding imports it.

The parse of vLLM's `speculative_config` dict lives below the engine, in minivllm/speculative_config.py:
`EngineConfig` validates the dict with it when it is built, and the config imports nothing of the engine.
"""

from __future__ import annotations

from minivllm.speculative_config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
