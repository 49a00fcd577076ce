import sys

from ray_specdec.cli import main

sys.exit(main())
