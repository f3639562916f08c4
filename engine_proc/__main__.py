import sys

from engine_proc.engine import main

sys.exit(main())
