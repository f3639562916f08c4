import sys

from frontend.server import main

sys.exit(main())
