"""Pure functions implementing the K3 math (no parameters, no devices)."""
