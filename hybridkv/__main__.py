import sys

from hybridkv.cli import main

sys.exit(main())
