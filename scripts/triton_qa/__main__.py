import sys

from scripts.triton_qa.runner import main

sys.exit(main())
