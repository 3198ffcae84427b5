import sys

from pier.cli import main

sys.exit(main())
