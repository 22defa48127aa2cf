import sys

from zppc.cli import main

sys.exit(main())
