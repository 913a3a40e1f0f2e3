"""The training launcher: ``python -m train CONFIG [key=value ...]`` (see `train.cli`)."""
