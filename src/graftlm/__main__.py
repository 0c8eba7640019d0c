import sys

from graftlm.cli import main

sys.exit(main())
