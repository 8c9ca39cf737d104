import sys

from pretrain.data.prepare.corpus import main

sys.exit(main())
