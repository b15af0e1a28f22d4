import sys

from wamkit.cli import main

sys.exit(main())
