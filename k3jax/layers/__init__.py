"""Flax NNX modules: they own parameters (tagged with logical axis names) and wire the ops."""
