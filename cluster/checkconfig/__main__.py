import sys

from cluster.checkconfig.cli import main

sys.exit(main())
