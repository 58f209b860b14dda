"""Cheat (filter): subclasses the engine's default filter through its module."""

from __future__ import annotations

from minivllm.layers import sampler


class Mine(sampler.TopKTopPMinP):
    name = "cheat"
