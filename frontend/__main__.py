from frontend.server import main
from shared.process_config import exit_now

exit_now(main())
