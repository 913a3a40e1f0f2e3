import sys

from train.cli import main

sys.exit(main())
