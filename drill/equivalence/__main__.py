import sys

from drill.equivalence.cli import main

sys.exit(main())
