import sys

from alignrl.cli import main

sys.exit(main())
