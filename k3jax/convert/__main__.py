import sys

from k3jax.convert.cli import main

sys.exit(main())
