import sys

from drill.soak.cli import main

sys.exit(main())
